"""The pool's NIXL agent: what a pool without NIXL says."""

from __future__ import annotations

import sys

import pytest

from kvpool.errors import InvalidRequest
from kvpool.server.remote.nixlagent import load_nixl


def test_without_nixl_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError
    with pytest.raises(InvalidRequest, match=r"--peers needs NIXL.*pip install -e '\.\[nixl\]' from a kvpool checkout"):
        load_nixl()
