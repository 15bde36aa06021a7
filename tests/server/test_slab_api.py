"""The slab endpoints under their names, and under the names from before the slab table was called so: a pool started
with the old flags, a client that calls the old paths, a dashboard that reads the old key and metric all keep
working, and the pool's log says once what to use instead."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpool.server.slab_api import PATHS
from tests.conftest import SMALL_POOL, LocalPool, PoolProcess, start_pool


@pytest.fixture(scope="module")
def old_pool() -> Iterator[PoolProcess]:
    pool = start_pool(*SMALL_POOL, "--leases", "--lease-regions", "4", "--slab-max-blocks", "16")
    yield pool
    pool.stop()


def session(http, name: str) -> str:
    r = http.post("/sessions", json={"name": name, "role": "other"})
    assert r.status_code == 200, r.text
    return str(r.json()["session_id"])


def logged(pool: PoolProcess, text: str, timeout_s: float = 5.0) -> int:
    """How many lines of the pool's log hold ``text``, once at least one does (the log is written asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        n = sum(text in line for line in pool.output().splitlines())
        if n or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def test_the_old_flags_serve_slabs_and_the_log_names_the_new_ones(old_pool: PoolProcess) -> None:
    assert logged(old_pool, "--leases (KVPOOL_LEASES) is deprecated: use --slabs (KVPOOL_SLABS)") == 1
    assert logged(old_pool, "--lease-regions (KVPOOL_LEASE_REGIONS) is deprecated: use --slab-regions") == 1
    stats = old_pool.stats()
    assert stats["slabs"]["regions_free"] == 4
    assert stats["leases"] == stats["slabs"]  # the old key, the same books


def test_each_old_path_answers_as_the_new_one_and_is_logged_once(old_pool: PoolProcess) -> None:
    assert PATHS == {"/slabs": "/leases", "/slabs/blocks": "/leases/slab", "/slabs/pair": "/leases/pair",
                     "/slabs/settle": "/leases/settle"}  # fmt: skip
    with old_pool.http() as http:
        sid = session(http, "old-client")
        new = http.post("/slabs", json={"session_id": sid})
        old = http.post("/leases", json={"session_id": sid})
        assert new.status_code == old.status_code == 200
        assert old.json() == new.json()  # asking again answers the same region
        assert "kvpool-slabs-" in new.json()["table"]
        taken = http.post("/leases/slab", json={"session_id": sid, "take": 3})
        assert taken.status_code == 200 and len(taken.json()["block_ids"]) == 3
        given = http.post("/slabs/blocks", json={"session_id": sid, "give": taken.json()["block_ids"][:1]})
        assert given.status_code == 200
        for path in ("/leases/settle", "/slabs/settle"):
            assert http.post(path, json={"session_id": sid, "regions": [new.json()["region"]]}).status_code == 200
        for path in ("/leases/pair", "/slabs/pair"):  # the same refusal under both names: no such name
            r = http.post(path, json={"session_id": sid, "to": "nobody"})
            assert r.status_code == 400 and "nobody" in r.json()["detail"]
        assert old_pool.stats()["in_use"] == 2  # three taken, one given back
        http.post("/leases", json={"session_id": sid})
        metrics = http.get("/metrics").text
        schema = http.get("/openapi.json").json()["paths"]
        http.delete(f"/sessions/{sid}")
    assert logged(old_pool, "POST /leases is deprecated: use POST /slabs ") == 1  # called twice, said once
    assert logged(old_pool, "POST /leases/slab is deprecated: use POST /slabs/blocks") == 1
    assert "kvpool_slab_regions 1.0" in metrics and "kvpool_lease_regions 1.0" in metrics
    for new_path, old_path in PATHS.items():
        assert not schema[new_path]["post"].get("deprecated")
        assert schema[old_path]["post"]["deprecated"] is True


def test_a_pool_without_slabs_says_which_flag_serves_them(pool_server: LocalPool) -> None:
    with pool_server.http() as http:
        sid = session(http, "no-slabs")
        for path in ("/slabs", "/leases"):
            r = http.post(path, json={"session_id": sid})
            assert r.status_code == 400 and "start it with --slabs (KVPOOL_SLABS=1)" in r.json()["detail"]
