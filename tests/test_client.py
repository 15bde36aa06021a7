"""The client against a real pool process: two processes, one arena, block ids only."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvpool.client import PoolClient
from kvpool.errors import (
    HandoffNotFound,
    HandoffRefused,
    InvalidRequest,
    LayoutMismatch,
    NameTaken,
    NotOwner,
    PoolTimeout,
    UnknownSession,
)
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaFdRequest
from kvpool.routes import ARENA_FD
from tests.conftest import ROOT, SMALL_POOL, child_env, local_pool, start_pool

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    env = child_env()
    return subprocess.run(
        [sys.executable, "-m", "tests.pattern_worker", *args], capture_output=True, text=True, env=env, timeout=120
    )


def start_reader(url: str, request_id: str, n: int, name: str) -> subprocess.Popen[str]:
    """A reader process with an inbox under ``name``, already waiting in its claim when this returns."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.pattern_worker", "read", url, request_id, str(n), name],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "WAITING", line + proc.stderr.read() if proc.stderr else line
    return proc


@pytest.mark.slow
def test_a_pattern_written_by_one_process_is_read_by_another(pool_process):
    w = run_worker("write", pool_process.url, "req-1", "5")
    assert w.returncode == 0, w.stderr
    r = run_worker("read", pool_process.tcp_url, "req-1", "5")
    assert r.returncode == 0 and "READ OK" in r.stdout, r.stdout + r.stderr
    s = pool_process.stats()
    assert (s["free"], s["in_use"], s["handoffs"]) == (64, 0, 0)


@pytest.mark.slow
def test_a_prefix_committed_by_one_process_is_found_and_read_by_another(pool_process):
    from tests.pattern_worker import pattern, prompt_tokens

    w = run_worker("commit", pool_process.url, "-", "4")
    assert w.returncode == 0, w.stderr
    written = [int(b) for b in w.stdout.split("WROTE", 1)[1].split()]
    with PoolClient(pool_process.url, name="reader", layout=SMALL) as pool:
        arena = pool.arena()
        shared = prompt_tokens(4, SMALL.block_size)[: 3 * SMALL.block_size]
        hit = pool.lookup([*shared, 999, 998, 997, 996, 995])
        assert hit.block_ids == written[:3] and hit.num_tokens == 3 * SMALL.block_size
        want = pattern(arena, written)
        for (layer, kv), values in zip([(i, kv) for i in range(SMALL.num_layers) for kv in (0, 1)], want, strict=True):
            view = arena.k(layer) if kv == 0 else arena.v(layer)
            assert torch.equal(view[hit.block_ids], values[:3])
        pool.free(hit.block_ids)
    assert pool_process.stats()["cached"] == 4


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
def test_both_transports_give_the_same_answers(pool_server, fast):
    with PoolClient(pool_server.url, name="t", fast=fast) as pool:
        assert (pool.transport.fast_path is not None) == fast
        ids = pool.alloc(3)
        assert pool.commit(ids, list(range(10))).committed == 2
        assert pool.lookup(list(range(8))).block_ids == ids[:2]
        with pytest.raises(NotOwner, match="holds no reference"):
            pool.free([ids[0]] * 3)
        assert pool.free(ids[:2]) == 2
        pool.handoff("r", ids, 10)
        assert pool.claim("r").block_ids == ids
        with pytest.raises(HandoffNotFound):
            pool.claim("r", timeout_s=0.05)


def test_a_client_that_polls_for_answers_gets_the_same_answers(pool_server):
    """``reply_spin_s``: answers that come while the call polls, and one that comes after (a claim that waits)."""
    with PoolClient(pool_server.url, name="t-spin", reply_spin_s=0.0005) as pool:
        assert pool.transport.connection().spin_s == 0.0005
        ids = pool.alloc(3)
        assert pool.commit(ids, list(range(10))).committed == 2
        assert pool.lookup(list(range(8))).block_ids == ids[:2]
        assert pool.free(ids[:2]) == 2
        pool.handoff("r-spin", ids, 10)
        assert pool.claim("r-spin").block_ids == ids
        with pytest.raises(HandoffNotFound):
            pool.claim("r-spin", timeout_s=0.05)
        assert pool.free(ids) == 3


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
def test_lookup_many_answers_each_prompt_as_lookup_does(pool_server, fast):
    with PoolClient(pool_server.url, name="t", fast=fast) as pool:
        ids = pool.alloc(3)
        pool.commit(ids, list(range(12)), salt="tenant")
        prompts = [list(range(8)), [7, 7, 7, 7, 7], list(range(13)), list(range(3))]
        hits = pool.lookup_many(prompts, salt="tenant")
        assert [h.block_ids for h in hits] == [ids[:2], [], ids, []]
        assert [h.num_tokens for h in hits] == [8, 0, 12, 0]
        assert pool.lookup_many(prompts[:1])[0].block_ids == []  # without the salt: not found
        assert pool.free(ids[:2] + ids) == 5  # each hit took its own refs
        assert pool.free(ids) == 3


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
def test_a_commit_past_a_looked_up_prefix_is_one_call_that_lets_go(pool_server, fast):
    with PoolClient(pool_server.url, name="t", fast=fast) as pool:
        head, tail = pool.alloc(2), pool.alloc(2)
        tokens = [5000 + i for i in range(16)]
        pool.commit(head, tokens[:8], release=True)
        before = pool.stats()["in_use"]
        r = pool.commit(tail, tokens, start=2, release=True)
        assert (r.committed, r.duplicates, r.num_blocks, r.missing) == (2, 0, 4, 0)
        assert pool.stats()["in_use"] == before - 2  # the tail's refs let go
        hit = pool.lookup(tokens)
        assert hit.block_ids == head + tail
        pool.free(hit.block_ids)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
def test_commit_many_commits_each_as_commit_does_and_a_refusal_stays_alone(pool_server, fast):
    with PoolClient(pool_server.url, name="t", fast=fast) as pool, PoolClient(pool_server.url, name="o") as other:
        start = pool.stats()["in_use"]
        head, tail, one, theirs = pool.alloc(2), pool.alloc(2), pool.alloc(1), other.alloc(1)
        long, short = [6000 + i for i in range(16)], [7000 + i for i in range(4)]
        pool.commit(head, long[:8], release=True)
        got = pool.commit_many([(tail, long, 2), (theirs, [8000 + i for i in range(4)], 0), (one, short, 0)],
                               release=True)  # fmt: skip
        assert got[1] is None  # not this session's block: refused alone
        assert [(g.committed, g.missing) for g in (got[0], got[2])] == [(2, 0), (1, 0)]
        hits = pool.lookup_many([long, short])
        assert [h.block_ids for h in hits] == [head + tail, one]
        pool.free([i for h in hits for i in h.block_ids])
        assert pool.stats()["in_use"] == start + 1  # ``theirs``, still the other session's
        other.free(theirs)
        pool.session.session_id = "f" * 32  # a session the pool does not know: the error raises, nothing is taken
        with pytest.raises(UnknownSession):
            pool.commit_many([([], [], 0)])


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
def test_handoff_many_parks_each_as_handoff_does_and_a_refusal_stays_alone(pool_server, fast):
    with PoolClient(pool_server.url, name="p", fast=fast) as prefill, PoolClient(pool_server.url, name="d") as decode:
        prefill.handoff(f"taken-{fast}", prefill.alloc(1), 3)
        a, b, c = prefill.alloc(2), prefill.alloc(1), prefill.alloc(3)
        parks = [(f"a-{fast}", a, 8, {"k": 1}), (f"taken-{fast}", b, 3, None), (f"c-{fast}", c, 12, None)]
        got = prefill.handoff_many(parks)
        assert got[1] is None and [g.num_blocks for g in (got[0], got[2])] == [2, 3]
        claims = decode.claim_many([f"a-{fast}", f"c-{fast}", f"taken-{fast}"])
        assert [x.block_ids for x in claims] == [a, c, claims[2].block_ids] and claims[0].meta == {"k": 1}
        prefill.free(b)  # refused: still the producer's
        decode.free([i for x in claims for i in x.block_ids])
        prefill.session.session_id = "f" * 32
        with pytest.raises(UnknownSession):
            prefill.handoff_many([("x", [], 0, None)])


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
def test_claim_many_answers_each_handoff_as_claim_does(pool_server, fast):
    with PoolClient(pool_server.url, name="p") as prefill, PoolClient(pool_server.url, name="d", fast=fast) as decode:
        ids = [prefill.alloc(2), prefill.alloc(3)]
        prefill.handoff("one", ids[0], 5)
        prefill.handoff("two", ids[1], 9, meta={"digest": "x"})
        with PoolClient(pool_server.url, name="e") as other:
            theirs = prefill.alloc(1)
            prefill.handoff("theirs", theirs, 3, to="e")
            got = decode.claim_many(["two", "missing", "theirs", "one"], timeout_s=0.05)
            assert got[1] is None and got[2] is None  # not parked; addressed to another: refused alone
            assert [(c.request_id, c.block_ids, c.num_tokens) for c in (got[0], got[3])] == [
                ("two", ids[1], 9), ("one", ids[0], 5),
            ]  # fmt: skip
            assert got[0].meta == {"digest": "x"}
            assert other.claim_many(["theirs"])[0].block_ids == theirs
            assert other.free(theirs) == 1
        assert decode.claim_many(["one"], timeout_s=0.05) == [None]  # claimed already
        assert decode.free(ids[0] + ids[1]) == 5  # the blocks are the claimer's now
        assert pool_server.stats()["in_use"] == 0


@pytest.mark.parametrize("fast", [True, False], ids=["fast-channel", "http"])
def test_claim_many_raises_when_the_session_itself_is_gone(pool_server, fast):
    with PoolClient(pool_server.url, name="p") as prefill, PoolClient(pool_server.url, name="d", fast=fast) as decode:
        prefill.handoff("kept", prefill.alloc(2), 5)
        decode.session.session_id = "f" * 32  # a session the pool does not know (expired, or of another pool)
        with pytest.raises(UnknownSession):
            decode.claim_many(["kept", "other"], timeout_s=0.05)
        assert pool_server.stats()["handoffs"] == 1  # nothing was taken: the handoff waits for its claimer


def test_claim_waits_for_the_handoff(pool_server):
    with PoolClient(pool_server.url, name="p") as prefill, PoolClient(pool_server.url, name="d") as decode:
        got = {}

        def wait() -> None:
            got["claim"] = decode.claim(timeout_s=10)

        t = threading.Thread(target=wait)
        t.start()
        deadline = time.monotonic() + 10  # the claim waits in the pool before the handoff is parked
        while pool_server.stats().get("claims_waiting") != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pool_server.stats().get("claims_waiting") == 1
        ids = prefill.alloc(2)
        prefill.handoff("late", ids, 5)
        t.join(5)
        assert got["claim"].block_ids == ids and got["claim"].request_id == "late"


def test_views_alias_one_memory_across_clients_and_map_once(pool_server):
    with PoolClient(pool_server.url, name="a") as a, PoolClient(pool_server.tcp_url, name="b", fast=False) as b:
        arena = a.arena()
        assert b.arena() is arena  # one mapping per process
        ids = a.alloc(1)
        arena.k(1)[ids[0]].fill_(3.5)
        assert float(arena.raw.view(arena.k(0).dtype).sum()) == pytest.approx(3.5 * SMALL.block_layer_elems)
        assert arena.k(0).shape == (64, 4, 2, 8)


def test_a_model_with_another_layout_is_refused(pool_server):
    wrong = SMALL.model_copy(update={"head_dim": 16})
    with pytest.raises(LayoutMismatch, match="head_dim: pool 8 != yours 16"):
        PoolClient(pool_server.url, name="w", layout=wrong)
    with PoolClient(pool_server.url, name="ok", layout=SMALL) as pool:
        assert pool.arena().layout == SMALL
        with pytest.raises(LayoutMismatch, match="dtype"):
            pool.arena(SMALL.model_copy(update={"dtype": "bfloat16"}))


# -- direct handoffs: ids from producer to consumer, ownership through the pool --------------------------------


def run_direct_handoff(url: str, request_id: str, n: int, name: str, timeout_s: float = 60.0) -> None:
    """A writer process hands ``n`` blocks to the reader process called ``name``, which must read them directly."""
    reader = start_reader(url, request_id, n, name)
    try:
        w = run_worker("write", url, request_id, str(n), name)
        assert w.returncode == 0, w.stderr
        out, err = reader.communicate(timeout=timeout_s)
    finally:
        if reader.poll() is None:
            reader.kill()
    assert reader.returncode == 0 and "READ OK" in out and out.strip().endswith("direct"), out + err


@pytest.mark.slow
def test_a_direct_handoff_crosses_processes_and_moves_ownership_in_the_pool(pool_process):
    run_direct_handoff(pool_process.url, "req-direct", 5, "reader-0")
    s = pool_process.stats()
    assert (s["free"], s["in_use"], s["handoffs"], s["counters"]["claims"]) == (64, 0, 0, 1)


def test_addressed_handoffs_reach_a_consumer_that_is_not_watching_through_the_pool(pool_server):
    with (
        PoolClient(pool_server.url, name="prefill") as p,
        PoolClient(pool_server.url, name="decode-0", inbox=True, spin_s=0.0) as d,
        PoolClient(pool_server.url, name="prefill-http", fast=False) as ph,
    ):
        assert d.direct.inbox is not None and os.path.exists(d.direct.inbox.path)
        ids = ph.alloc(2)
        ph.handoff("over-http", ids, 5, to="decode-0")  # the pool delivers it, whatever way it came
        got = d.claim("over-http", timeout_s=5)
        assert (got.request_id, got.block_ids, got.direct) == ("over-http", ids, True)
        d.confirm()
        d.free(got.ids)
        # Delivered to the inbox but claimed through the pool (as when the ids land just after the claim stopped
        # watching; staged here by claiming through the pool directly): the copy left in the inbox is dropped,
        # never handed out a second time.
        ids = p.alloc(3)
        p.handoff("twice", array("q", ids), 9, to="decode-0")
        got = d._claim_from_pool("twice", 5)
        assert got.block_ids == ids and not got.direct
        d.free(got.block_ids)
        with pytest.raises(HandoffNotFound):
            d.claim(timeout_s=0.05)
        # The inbox cannot be reached (here: its name is gone): the handoff is parked anyway, and the claim gets
        # it through the pool.
        os.unlink(d.direct.inbox.path)
        ids = p.alloc(2)
        p.handoff("undelivered", array("q", ids), 6, to="decode-0")
        got = d.claim("undelivered", timeout_s=5)
        assert (got.request_id, got.block_ids, got.direct) == ("undelivered", ids, False)
        d.free(got.ids)
    assert pool_server.stats()["in_use"] == 0


def test_delivered_handoffs_are_claimed_first_and_in_order(pool_server):
    with (
        PoolClient(pool_server.url, name="prefill") as p,
        PoolClient(pool_server.url, name="decode-0", inbox=True) as d,
    ):
        sent = {}
        for rid in ("a", "b", "c"):
            sent[rid] = p.alloc(2)
            p.handoff(rid, sent[rid], 8, meta={"rid": rid}, to="decode-0")
        got = [d.claim(timeout_s=5) for _ in range(3)]
        assert [(g.request_id, g.block_ids, g.meta, g.direct) for g in got] == [
            (rid, sent[rid], {"rid": rid}, True) for rid in "abc"
        ]
        d.confirm()
        assert d.free([b for g in got for b in g.block_ids]) == 6
    assert pool_server.stats()["in_use"] == 0


def test_a_refused_direct_handoff_is_never_delivered_and_its_claim_fails_at_once(pool_server):
    with (
        PoolClient(pool_server.url, name="prefill") as p,
        PoolClient(pool_server.url, name="decode-0", inbox=True) as d,
    ):
        theirs = d.alloc(1)
        with pytest.raises(NotOwner):
            p.handoff("bogus", theirs, 1, to="decode-0")  # the producer's bug: blocks it does not hold
        before = pool_server.stats()
        with pytest.raises(HandoffRefused, match=r"'bogus'.*refused when its producer made it"):
            d.claim("bogus", timeout_s=5)  # no seal, so nothing was sent: the pool says why at once
        assert pool_server.stats()["in_use"] == before["in_use"]
        assert d.free(theirs) == 1  # its own block, untouched by the refused claim
    assert pool_server.stats()["in_use"] == 0


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "http"])
def test_a_handoff_to_a_consumer_that_ended_reaches_no_stranger(pool_server, fast):
    """Delivered to decode-0's inbox, which ends before it claims: no other session gets it, not one that opens
    under the same name next (a restarted worker, or a stranger), not a claim of the oldest. A claim of it says
    why, its producer learns it the same way, its blocks are back, and what comes after reaches the new holder."""
    with PoolClient(pool_server.url, name="prefill", fast=fast) as p:
        d = PoolClient(pool_server.url, name="decode-0", inbox=True)
        ids = p.alloc(2)
        assert p.handoff("for-d", ids, 5, to="decode-0").inbox == d.direct.inbox.path
        d.close()
        with (
            PoolClient(pool_server.url, name="decode-0", inbox=fast, fast=fast) as again,
            PoolClient(pool_server.url, name="other", fast=fast) as other,
        ):
            with pytest.raises(HandoffNotFound):
                again.claim(timeout_s=0.2)
            with pytest.raises(HandoffRefused, match="addressee, session 'decode-0', ended before it claimed it"):
                other.claim("for-d", timeout_s=5)
            with pytest.raises(HandoffRefused, match="ended before it claimed it"):
                p.claim("for-d", timeout_s=0)  # the producer asks: refused, and why
            s = pool_server.stats()
            assert (s["in_use"], s["handoffs"], s["counters"]["handoffs_orphaned"]) == (0, 0, 1)
            ids = p.alloc(2)
            p.handoff("for-d-again", ids, 5, to="decode-0")
            got = again.claim(timeout_s=5)
            assert (got.request_id, got.block_ids, got.direct) == ("for-d-again", ids, fast)
            again.confirm()
            again.free(got.ids)
    assert pool_server.stats()["in_use"] == 0


def test_a_consumer_s_name_key_keeps_its_name_through_a_restart(pool_server, monkeypatch):
    """While decode-0 restarts, nobody without its key can open a session under its name (over HTTP or through the
    client: 409, and nothing changes), so what its producer addresses meanwhile is refused to the producer, never
    handed to a stranger; back with its key (here from KVPOOL_NAME_KEY), it gets its handoffs to its inbox."""
    key = "decode-0's secret, from its environment"
    with PoolClient(pool_server.url, name="prefill") as p, pool_server.http() as http:
        PoolClient(pool_server.url, name="decode-0", inbox=True, name_key=key).close()
        before = pool_server.stats()
        with pytest.raises(NameTaken, match="'decode-0' is held under a name key"):
            PoolClient(pool_server.url, name="decode-0", inbox=True)
        answer = http.post("/sessions", json={"name": "decode-0", "role": "decode", "name_key": "x" * 16})
        assert answer.status_code == 409 and answer.json()["error"] == "NameTaken"
        short = http.post("/sessions", json={"name": "decode-0", "name_key": "short"})
        assert short.status_code == 422 and "name_key" in short.text
        after = pool_server.stats()
        assert (after["sessions"], after["counters"]["sessions_opened"]) == (
            before["sessions"], before["counters"]["sessions_opened"],
        )  # fmt: skip
        ids = p.alloc(2)
        with pytest.raises(InvalidRequest, match="no live session is named 'decode-0'"):
            p.handoff("while-down", ids, 5, to="decode-0")
        monkeypatch.setenv("KVPOOL_NAME_KEY", key)
        with PoolClient(pool_server.url, name="decode-0", inbox=True) as back:
            p.handoff("after", ids, 5, to="decode-0")
            got = back.claim("after", timeout_s=5)
            assert (got.block_ids, got.direct) == (ids, True)
            back.confirm()
            back.free(got.ids)
    assert pool_server.stats()["in_use"] == 0


def test_block_ids_travel_packed_as_arrays_numpy_and_tensors(pool_server):
    with PoolClient(pool_server.url, name="t") as a, PoolClient(pool_server.url, name="h", fast=False) as h:
        ids = a.alloc(48)
        assert ids == list(range(48))
        assert a.free(array("q", ids[:16])) == 16
        assert a.free(np.array(ids[16:32], dtype=np.int32)) == 16
        assert a.free(torch.tensor(ids[32:], dtype=torch.int64)) == 16
        more = h.alloc(8)
        assert h.free(np.array(more, dtype=np.int64)) == 8  # HTTP: the same ids as JSON
    assert pool_server.stats()["free"] == 64


def test_sessions_are_listed_by_name_never_by_id_and_inboxes_go_with_them(pool_server):
    with PoolClient(pool_server.url, name="decode-0", role="decode", inbox=True) as d:
        assert d.direct.inbox is not None
        path = d.direct.inbox.path
        with PoolClient(pool_server.url, name="other") as o:
            listed = o.sessions("decode-0")
            assert [(s.name, s.role, s.inbox) for s in listed] == [("decode-0", "decode", path)]
            assert d.session_id not in pool_server.http().get("/sessions").text
            assert {s.name for s in o.sessions()} == {"decode-0", "other"}
    assert not os.path.exists(path)  # closed by the client, and deleted by the pool with the session


def test_salted_prefixes_over_a_sha256_pool():
    """A pool started with --prefix-hash sha256 says so in its descriptor; a salt travels with lookup and commit on
    both ways to the pool, and only a lookup with the committing salt finds the blocks."""
    pool = local_pool(*SMALL_POOL, "--prefix-hash", "sha256")
    try:
        with PoolClient(pool.url, name="tenant-a") as fast, PoolClient(pool.url, name="tenant-b", fast=False) as http:
            assert fast.descriptor().prefix_hash == "sha256"
            prompt = list(range(8))
            for client, salt in ((fast, "tenant-a"), (http, "tenant-b")):
                ids = client.alloc(2)
                assert client.commit(ids, prompt, salt=salt).committed == 2
                client.free(ids)
                for other in (None, "tenant-c"):
                    assert client.lookup(prompt, salt=other).block_ids == []
                hit = client.lookup(prompt, salt=salt)
                assert hit.block_ids == ids and hit.num_tokens == 8
                client.free(hit.block_ids)
    finally:
        pool.stop()


def bounded(call: Callable[[], object], limit_s: float) -> tuple[float, BaseException | None]:
    """How long ``call`` took and what it raised; (``limit_s``, None) if it was still blocked then."""
    out: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            call()
        except BaseException as exc:
            out["error"] = exc
        out["took"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    return out.get("took", limit_s), out.get("error")


@pytest.mark.slow
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "http"])
def test_every_call_ends_within_its_time_out_when_the_pool_stops_answering(fast):
    """A pool stopped with SIGSTOP answers nothing: each call raises PoolTimeout within ``timeout_s`` (plus a
    claim's own wait), whether it goes over a kept connection, a new one (whose hello goes unanswered) or the fd
    exchange. Once the pool goes on, each call gets its own answer, never a late one of a call that timed out."""
    timeout = 1.5
    pool = start_pool(*SMALL_POOL, "--lease-ttl-s", "60")  # the lease runs on while the pool is stopped
    try:
        with PoolClient(pool.url, name="w", timeout_s=timeout, fast=fast, heartbeat=False) as c:
            held = c.alloc(1)
            fd_request = ArenaFdRequest(session_id=c.session_id)
            calls = [
                ("alloc", lambda: c.alloc(2), 0.0),
                ("alloc over a new connection", lambda: c.alloc(2), 0.0),
                ("free", lambda: c.free(held), 0.0),
                ("lookup", lambda: c.lookup([1, 2, 3, 4]), 0.0),
                ("claim", lambda: c.claim("nobody", timeout_s=1.0), 1.0),
                ("arena fd", lambda: c.transport.fetch_fd(ARENA_FD, fd_request, f"{pool.socket}.fast"), 0.0),
            ]
            os.kill(pool.proc.pid, signal.SIGSTOP)
            try:
                for name, call, wait_s in calls:
                    took, error = bounded(call, timeout + wait_s + 10.0)
                    assert isinstance(error, PoolTimeout), (name, repr(error))
                    assert took < timeout + wait_s + 2.0, (name, took)
                    assert "timeout_s" in str(error), error
            finally:
                os.kill(pool.proc.pid, signal.SIGCONT)
            mine = c.alloc(3)
            assert len(mine) == 3 and c.free(mine) == 3
            with pytest.raises(HandoffNotFound, match="nobody"):
                c.claim("nobody", timeout_s=0)
    finally:
        pool.stop()


PLAIN = """
import os, sys
from kvpool.client import PoolClient
for blocks in (None, "8"):  # a slab's size in the environment makes no plain client a slab client
    if blocks is not None:
        os.environ["KVPOOL_SLAB_BLOCKS"] = blocks
    with PoolClient(sys.argv[1], name="plain", inbox=True) as c:
        ids = c.alloc(2)
        c.commit(ids, list(range(8)))
        c.handoff("req-plain", ids, 8, to="plain")
        c.free(c.claim("req-plain", timeout_s=5).block_ids)
        c.free(c.lookup(list(range(8))).block_ids)
        assert type(c) is PoolClient and not hasattr(c, "slab")
print(sorted(m for m in sys.modules if m.startswith("kvpool.slab")))
"""


@pytest.mark.slow
def test_a_client_without_a_slab_never_imports_the_slab_code(pool_process):
    """The slab stands on the client: a PoolClient is never a slab client, and its calls reach no slab module (none is
    even imported)."""
    env = child_env()
    env.pop("KVPOOL_SLAB_BLOCKS", None)
    proc = subprocess.run([sys.executable, "-c", PLAIN, pool_process.url], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


def test_the_slab_client_is_a_subclass_the_plain_client_never_names(pool_server, monkeypatch):
    """``SlabClient`` is a PoolClient subclass, asked for by name: PoolClient takes no ``slab``, its module names no
    slab, and the environment never turns one into the other. Where the pool serves no slabs a SlabClient has none,
    and every call goes through the pool as a plain client's would."""
    from kvpool.slab import SlabClient, SlabConfig

    assert "slab" not in (ROOT / "kvpool" / "client.py").read_text().lower()
    with pytest.raises(TypeError, match="slab"):
        PoolClient(pool_server.url, name="plain", slab=True)
    with SlabClient(pool_server.url, name="asked", slab=True) as c:
        assert type(c) is SlabClient and isinstance(c, PoolClient) and c.slab_config == SlabConfig()
        assert c.slab is None  # this pool serves none
        ids = c.alloc(3)
        c.handoff("req-asked", ids, 12, to="asked")
        assert c.claim("req-asked", timeout_s=5).block_ids == ids
        assert c.free(ids) == 3
    monkeypatch.setenv("KVPOOL_SLAB_BLOCKS", "8")
    with SlabClient(pool_server.url, name="from-env") as c, PoolClient(pool_server.url) as d:
        assert c.slab_config is not None and c.slab_config.blocks == 8 and type(d) is PoolClient
    assert pool_server.stats()["in_use"] == 0


class FakeCuda:
    def __init__(self, initialized: bool, on_sync: Callable[[Any], None]) -> None:
        self.initialized, self.on_sync = initialized, on_sync

    def is_initialized(self) -> bool:
        return self.initialized

    def synchronize(self, device: Any = None) -> None:
        self.on_sync(device)


def test_close_waits_for_the_device_before_the_session_ends(pool_server, monkeypatch) -> None:
    """Kernels in flight finish before the pool may give the session's blocks to another engine."""
    synced: list[tuple[Any, int]] = []
    cuda = FakeCuda(True, lambda device: synced.append((device, pool_server.stats()["sessions"])))
    monkeypatch.setitem(sys.modules, "torch", type("FakeTorch", (), {"cuda": cuda}))
    client = PoolClient(pool_server.url, name="closing")
    client.alloc(2)
    client.close()
    assert synced == [(None, 1)] and pool_server.stats()["sessions"] == 0  # synced while the session was open


def test_close_neither_imports_torch_nor_syncs_a_device_never_used(pool_server, monkeypatch) -> None:
    from kvpool.client import settle_device

    synced: list[Any] = []
    monkeypatch.setitem(sys.modules, "torch", type("FakeTorch", (), {"cuda": FakeCuda(False, synced.append)}))
    settle_device()
    monkeypatch.delitem(sys.modules, "torch")
    settle_device()
    assert synced == [] and "torch" not in sys.modules


def test_a_delivery_to_an_inbox_says_who_parked_it(pool_server) -> None:
    """A claim answered by the pool says parked_by; one delivered straight to an inbox said nothing, so a consumer
    checking its producer could not tell who parked what it read."""
    inbox = PoolClient(pool_server.url, name="decode-1", inbox=True)
    with inbox, PoolClient(pool_server.url, name="prefill-1") as prefill:
        prefill.handoff("direct", prefill.alloc(1), 4, to="decode-1")
        got = inbox.claim("direct", timeout_s=5)
        assert (got.direct, got.parked_by) == (True, "prefill-1")
        inbox.confirm()
        inbox.free(got.ids)
