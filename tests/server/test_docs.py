"""/docs and /redoc work on a node with no way out: every script and style they load comes from the pool."""

from __future__ import annotations

import re

import pytest

from tests.conftest import LocalPool


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_only_local_assets(pool_server: LocalPool, page: str) -> None:
    with pool_server.http() as http:
        r = http.get(page)
        assert r.status_code == 200 and "text/html" in r.headers["content-type"]
        refs = re.findall(r"""(?:src|href|url)\s*[=:]\s*['"]([^'"]+)['"]""", r.text)
        assert refs, r.text
        for ref in refs:
            assert ref.startswith("/"), f"{page} loads {ref} from elsewhere"
            assert http.get(ref).status_code == 200, ref


def test_every_operation_has_a_description(pool_server: LocalPool) -> None:
    with pool_server.http() as http:
        schema = http.get("/openapi.json").json()
    for path, item in schema["paths"].items():
        for method, op in item.items():
            assert op.get("description", "").strip(), f"{method.upper()} {path} has no description"
