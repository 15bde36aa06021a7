"""The slab endpoints: a session's region, its slab's blocks, pair keys and settling, each at its one path; the names
from before the slab table was called so are gone (no release carried them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.server.config import PoolSettings
from kvpool.server.main import serve_parser
from kvpool.server.transports.local import LocalPool
from tests.conftest import SMALL_POOL, local_pool


@pytest.fixture(scope="module")
def slab_pool() -> Iterator[LocalPool]:
    pool = local_pool(*SMALL_POOL, "--slabs", "--slab-regions", "4", "--slab-max-blocks", "16")
    yield pool
    pool.stop()


def session(http, name: str) -> str:
    r = http.post("/sessions", json={"name": name, "role": "other"})
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def test_each_endpoint_answers_at_its_path(slab_pool: LocalPool) -> None:
    with slab_pool.http() as http:
        sid = session(http, "client")
        region = http.post("/slabs", json={"session_id": sid})
        assert region.status_code == 200 and "kvpool-slabs-" in region.json()["table"]
        assert http.post("/slabs", json={"session_id": sid}).json() == region.json()  # asking again: the same region
        taken = http.post("/slabs/blocks", json={"session_id": sid, "take": 3})
        assert taken.status_code == 200 and len(taken.json()["block_ids"]) == 3
        given = http.post("/slabs/blocks", json={"session_id": sid, "give": taken.json()["block_ids"][:1]})
        assert given.status_code == 200
        settled = http.post("/slabs/settle", json={"session_id": sid, "regions": [region.json()["region"]]})
        assert settled.status_code == 200
        r = http.post("/slabs/pair", json={"session_id": sid, "to": "nobody"})
        assert r.status_code == 400 and "nobody" in r.json()["detail"]
        assert slab_pool.stats()["in_use"] == 2  # three taken, one given back
        assert "kvpool_slab_regions 1.0" in http.get("/metrics").text
        http.delete(f"/sessions/{sid}")


def test_the_names_from_before_the_slab_table_are_gone(slab_pool: LocalPool, monkeypatch) -> None:
    with slab_pool.http() as http:
        sid = session(http, "old-client")
        for path in ("/leases", "/leases/slab", "/leases/pair", "/leases/settle"):
            assert http.post(path, json={"session_id": sid}).status_code == 404, path
        assert "kvpool_lease_regions" not in http.get("/metrics").text
        http.delete(f"/sessions/{sid}")
    assert "leases" not in slab_pool.stats() and "slabs" in slab_pool.stats()
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--leases"])
    monkeypatch.setenv("KVPOOL_LEASES", "1")
    assert PoolSettings().slabs is False


def test_a_pool_without_slabs_says_which_flag_serves_them(pool_server: LocalPool) -> None:
    with pool_server.http() as http:
        sid = session(http, "no-slabs")
        r = http.post("/slabs", json={"session_id": sid})
        assert r.status_code == 400 and "start it with --slabs (KVPOOL_SLABS=1)" in r.json()["detail"]
