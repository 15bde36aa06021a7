"""The soak script in CI: a short run of ``benchmarks/soak.py`` (16 clients, 8 s) that must pass its own checks,
plus the checks themselves, shown to fire on books that do not balance and on pools that are not local.

The full 60 s run is ``python -m kvpool.benchmarks.soak`` (or ``kvpool bench soak``); this is the same code, shorter.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.benchmarks import soak, soak_client
from tests.conftest import ROOT, SMALL_POOL, local_pool, start_pool


def run_soak(*args: str, timeout_s: float = 180) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
    env["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:  # the report's JSON and PNG too, not the checkout's
        out = Path(tmp) / "summary.json"
        proc = subprocess.run(
            [sys.executable, "-m", "kvpool.benchmarks.soak", *args, "--json", str(out), "--out", tmp],
            capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, env=env, check=False,
        )  # fmt: skip
        summary = json.loads(out.read_text()) if out.exists() else {}
    return proc, summary


@pytest.mark.slow
def test_short_soak_passes_with_16_clients() -> None:
    proc, s = run_soak("--duration", "8", "--clients", "16", "--crash-every", "2")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "PASS" in proc.stdout and "ops/s" in proc.stdout
    assert s["violations"] == 0, s["violation_messages"]
    assert sum(s["clients"].values()) == 16 and set(s["clients"]) == {"fast", "http-uds", "http-tcp"}
    assert all(s["ops"][op] > 50 for op in soak_client.OPS), s["ops"]
    assert s["samples"] >= 20, "the books must have been sampled all along"
    assert s["crashed_workers"] >= 1
    refused = {k: n for k, n in s["ops"].items() if k.startswith("stale ")}
    assert sum(refused.values()) == s["ops"]["stale"] and s["stale_refused"] > 0, s["ops"]
    assert s["end"]["in_use"] == 0 and s["end"]["handoffs"] == 0 and s["end"]["sessions"] == 0
    assert set(s["errors"]) <= {"alloc PoolExhausted", "claim HandoffNotFound"}, s["errors"]


@pytest.mark.slow
def test_short_soak_with_a_host_tier_balances_both_tiers() -> None:
    """An arena too small for the clients' prefixes: evictions go to the host tier and lookups restore them, while
    workers are killed (some while the pool restores a prefix for them); every block's bytes are checked."""
    proc, s = run_soak("--duration", "8", "--clients", "12", "--crash-every", "1", "--num-blocks", "48",
                       "--host-blocks", "96")  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert s["violations"] == 0, s["violation_messages"]
    assert s["verify_data"] and s["crashed_workers"] >= 1
    host = s["host_tier"]
    assert host["num_blocks"] == 96 and host["offloaded_blocks"] > 0 and host["restored_blocks"] > 0, host
    assert host["hit_blocks"] == host["restored_blocks"]
    assert s["end"]["in_use"] == 0 and s["end"]["sessions"] == 0


@pytest.mark.slow
def test_soak_against_a_given_pool() -> None:
    pool = start_pool(*SMALL_POOL, "--lease-ttl-s", "2")
    try:
        proc, s = run_soak("--url", pool.url, "--duration", "3", "--clients", "4", "--crash-every", "0")
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        assert s["violations"] == 0 and sum(s["ops"].values()) > 100
        stats = pool.stats()
        assert stats["in_use"] == 0 and stats["handoffs"] == 0
    finally:
        pool.stop()


@pytest.mark.parametrize("url", ["http://10.1.2.3:8470", "http://example.com:8470", "https://127.0.0.1:8470"])
def test_soak_refuses_a_pool_that_is_not_local(url: str) -> None:
    with pytest.raises(SystemExit, match="refusing"):
        soak.check_local(url)


@pytest.mark.parametrize("url", ["unix:///tmp/x.sock", "http://127.0.0.1:8470", "http://localhost:1", "http://[::1]:2"])
def test_soak_accepts_local_pools(url: str) -> None:
    soak.check_local(url)


def test_balance_check_flags_books_that_do_not_add_up() -> None:
    tally = soak_client.Tally()
    soak.check_balance({"free": 10, "in_use": 5, "cached": 1, "num_blocks": 16}, tally, "sample")
    assert tally.violation_count == 0 and tally.samples == 1
    soak.check_balance({"free": 10, "in_use": 5, "cached": 2, "num_blocks": 16}, tally, "sample")
    soak.check_balance({"free": 17, "in_use": -1, "cached": 0, "num_blocks": 16}, tally, "sample")
    assert tally.violation_count == 2
    assert "do not balance" in tally.violations[0]


def test_a_slab_handoff_its_consumer_dropped_is_a_violation() -> None:
    """The producer was told the handoff went: a consumer that drops it (as one did when it read a ring's ids from
    slots the producer had reused) loses it, whatever the books say."""
    tally = soak_client.Tally()
    log = logging.getLogger("kvpool.slab.box")
    handler = soak_client.DroppedHandoffs(tally)
    log.addHandler(handler)
    try:
        log.debug("dropped a slab handoff from region 3: no such session")  # the producer is gone: not a loss
        log.warning("dropped slab handoff 'r1': neither its producer's region nor the pool vouch")
    finally:
        log.removeHandler(handler)
    assert tally.violation_count == 1 and "r1" in tally.violations[0]


@pytest.mark.slow
def test_short_soak_with_slabs_balances_and_loses_nothing() -> None:
    """Slabs hold blocks outside the free list and hand them over with no pool on the way: the books must still
    balance at every sample, killed workers' slabs (and what they handed) must come back, and nothing may be left."""
    proc, s = run_soak("--duration", "8", "--clients", "16", "--crash-every", "2", "--slabs")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert s["violations"] == 0, s["violation_messages"]
    assert s["ops"].get("handoff, slab to slab", 0) > 20, s["ops"]
    assert s["samples"] >= 20 and s["crashed_workers"] >= 1
    assert s["book_checks"] >= 16 and s["stranded_blocks"] == 0, "the live books were checked, and nothing stranded"
    assert s["end"]["in_use"] == 0 and s["end"]["handoffs"] == 0 and s["end"]["sessions"] == 0
    assert set(s["errors"]) <= {"alloc PoolExhausted", "claim HandoffNotFound"}, s["errors"]


@pytest.mark.slow
def test_short_soak_with_slabs_and_a_host_tier_serves_no_client_anothers_kv() -> None:
    """A slab's refill evicts prefix blocks into the host tier like any alloc: the owner's writes must never come
    back as a prefix hit (every seed failed with thousands of hits holding another client's stamp)."""
    proc, s = run_soak("--duration", "8", "--clients", "16", "--crash-every", "2", "--slabs", "--host-blocks", "64")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert s["violations"] == 0, s["violation_messages"]
    assert s["verify_data"] and s["host_tier"]["restored_blocks"] > 0, s["host_tier"]
    assert s["stranded_blocks"] == 0 and s["end"]["in_use"] == 0


def test_live_books_flag_a_block_a_session_holds_that_its_client_does_not_know() -> None:
    """The soak's live check, shown to fire: a block the pool's books put in a client's session while the client
    does not know of it (here, allocated behind its back) is stranded, and found while the client lives."""
    pool = local_pool(*SMALL_POOL)
    tally = soak_client.Tally()
    shared = soak_client.Shared(tally, block_size=4, handoff_ttl_s=2.0, seed=0, verify_data=False)
    client = soak_client.Client(0, pool.url, False, shared)
    try:
        assert client.pool.alloc(1)  # not in the client's refs: unknown to it
        stop = threading.Event()
        checker = threading.Thread(target=soak.check_books, args=(pool.url, None, [client], tally, stop, 0.1))
        checker.start()
        deadline = time.monotonic() + 10
        while not tally.violation_count and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        checker.join()
        assert tally.violation_count >= 1 and "stranded" in tally.violations[0], tally.violations
        assert tally.stranded >= 1
    finally:
        client.pool.close()
        pool.stop()
