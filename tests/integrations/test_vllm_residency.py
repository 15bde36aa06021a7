"""Resident mode's books without vLLM, against a real pool with a kv_packed arena and slabs: engines share KV by
block id, hold one ref on each block they use, and give every block back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from kvpool.client import PoolClient
from kvpool.errors import PoolExhausted
from kvpool.integrations.vllm.residency import PoolGone, Residency
from kvpool.layout import KVLayout
from kvpool.slab import SlabClient, SlabConfig
from tests.conftest import SMALL_POOL, LocalPool, PoolProcess, local_pool, start_pool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32", order="kv_packed")
BS = LAYOUT.block_size
N = 64
RESIDENT_POOL = (*SMALL_POOL, "--order", "kv_packed", "--slabs", "--slab-max-blocks", "64", "--lease-ttl-s", "2")


class Engine:
    """One engine's residency and its view of the arena, as the resident connector's scheduler side has them."""

    def __init__(self, url: str, name: str) -> None:
        self.client = SlabClient(
            url, name=name, layout=LAYOUT, slab=SlabConfig(blocks=8, low=2, high=48, handoffs=False)
        )
        slab = self.client.slab
        assert slab is not None, "the pool serves slabs"
        self.slab = slab
        self.res = Residency(self.client, BS, N, free_count=slab.idle_count, grow=slab.ensure_idle,
                             ahead=slab.refill_ahead,
                             alive=lambda: self.client.session.lost or self.client.session.unreachable)  # fmt: skip
        self.arena = self.client.arena()

    def compute(self, blocks: list[int], tokens: list[int]) -> None:
        """The forward: each block's KV is a function of its whole prefix, as real KV is."""
        for i, b in enumerate(blocks):
            for layer in range(LAYOUT.num_layers):
                self.arena.k(layer)[b].fill_(stamp(tokens, i))
                self.arena.v(layer)[b].fill_(-stamp(tokens, i))

    def publish(self, prompt: list[int], n: int) -> list[int]:
        """A request's life in this engine: ``n`` blocks taken, computed, committed, and freed by vLLM."""
        blocks = self.res.take(n)
        self.compute(blocks, prompt)
        self.res.commit(blocks, prompt[: n * BS])
        self.res.leave(blocks)
        self.res.drain()
        return blocks

    def close(self) -> None:
        self.res.close()
        self.client.close()


def stamp(tokens: list[int], i: int) -> float:
    return float(hash(tuple(tokens[: (i + 1) * BS])) % 9973)


def holds(arena, blocks: list[int], tokens: list[int]) -> bool:
    return all(
        bool((arena.k(layer)[b] == stamp(tokens, i)).all() and (arena.v(layer)[b] == -stamp(tokens, i)).all())
        for i, b in enumerate(blocks)
        for layer in range(LAYOUT.num_layers)
    )


def held_by(pool: PoolProcess | LocalPool, engine: Engine) -> set[int]:
    """The blocks the pool's books say the engine's session holds refs on."""
    with pool.http() as http:
        ids = http.get(f"/sessions/{engine.client.session_id}/blocks").json()["block_ids"]
    return {i & 0xFFFFFFFF for i in ids}


def books(url: str) -> dict:
    with PoolClient(url, name="probe", heartbeat=False) as c:
        s = c.stats()
    assert s["free"] + s["in_use"] + s["cached"] == s["num_blocks"], s
    return s


@pytest.fixture
def pool() -> Iterator[LocalPool]:
    proc = local_pool(*RESIDENT_POOL)
    yield proc
    proc.stop()


@pytest.fixture
def pool_process() -> Iterator[PoolProcess]:
    """The same pool as a process: a killed engine of another process reaches it only so."""
    proc = start_pool(*RESIDENT_POOL)
    yield proc
    proc.stop()


def test_a_prefix_one_engine_computed_is_another_s_hit_in_the_same_blocks(pool: LocalPool) -> None:
    a, b = Engine(pool.url, "a"), Engine(pool.url, "b")
    try:
        prompt = list(range(100, 100 + 5 * BS + 1))
        blocks = a.res.take(6)
        assert 0 not in blocks, "block 0 is vLLM's null block: never handed out"
        a.compute(blocks[:5], prompt)
        assert a.res.commit(blocks, prompt[: 5 * BS]) == 5
        a.res.leave(blocks)  # vLLM freed them: the committed five go to the pool's LRU, the sixth to the slab
        a.res.drain()
        assert (a.res.counters.left_to_pool, a.res.counters.left_to_slab) == (5, 1)
        b.res.prefetch("r1", prompt)
        hit = b.res.answer("r1")
        assert hit is not None and hit.num_tokens == 5 * BS
        got, again = b.res.install("r1", hit, 5)
        assert got == blocks[:5] and again == [], "the very blocks engine a wrote, not copies"
        assert holds(b.arena, got, prompt)
        assert a.res.counters.copied_blocks == b.res.counters.copied_blocks == 0
        more = b.res.take(1)  # b's own block for the prompt's last token, never committed
        b.res.unpin("r1")
        b.res.leave([*got, *more])
        assert (b.res.counters.left_to_pool, b.res.counters.left_to_slab) == (5, 1), (
            "hits to the pool, its own to the slab"
        )
        assert b.res.held == {}
    finally:
        a.close()
        b.close()
    assert books(pool.url)["in_use"] == 1  # only the null block


def test_an_engine_holds_one_ref_per_block_however_many_requests_hit_it(pool: LocalPool) -> None:
    a, b = Engine(pool.url, "a"), Engine(pool.url, "b")
    try:
        prompt = list(range(7, 7 + 4 * BS + 1))
        blocks = a.publish(prompt, 4)
        installed = []
        for req in ("r1", "r2"):
            b.res.prefetch(req, prompt)
            installed.append(b.res.install(req, b.res.answer(req), 4))
        assert installed == [(blocks, []), (blocks, blocks)], "the second request's blocks are held already"
        b.res.drain()
        assert set(b.res.held) == set(blocks) and all(b.res.pins[x] == 2 for x in blocks)
        # the pool may evict none of them while b holds them: a third session can take only the rest
        with PoolClient(pool.url, name="c") as c:
            free = books(pool.url)["free"] + books(pool.url)["cached"]
            with pytest.raises(PoolExhausted):
                c.alloc(free + 1)
        assert b.res.unpin("r1") == []
        left = b.res.unpin("r2")
        assert sorted(left) == sorted(blocks)
        b.res.leave(left)
        b.res.drain()
        assert b.res.held == {}
        with PoolClient(pool.url, name="c") as c:  # now every cached block can be evicted: b holds nothing
            avail = books(pool.url)["free"] + books(pool.url)["cached"]
            ids = c.alloc(avail)
            assert set(blocks) <= {i & 0xFFFFFFFF for i in ids}
            c.free(ids)
    finally:
        a.close()
        b.close()


def test_the_refs_a_hit_took_past_its_request_s_blocks_go_back_at_the_next_step(pool: LocalPool) -> None:
    """The pool's hit of a prompt of five full blocks whose request uses four (its last token is computed): the
    fifth ref goes back at the scheduler's next step, not from inside the install (a decode engine's handover)."""
    a, b = Engine(pool.url, "a"), Engine(pool.url, "b")
    try:
        prompt = list(range(40, 40 + 5 * BS + 1))
        blocks = a.publish(prompt, 5)
        b.res.prefetch("r1", prompt)
        hit = b.res.answer("r1")
        assert hit is not None and len(hit.ids) == 5
        assert b.res.install("r1", hit, 4) == (blocks[:4], [])
        b.res.writes.drain()
        assert blocks[4] in held_by(pool, b), "still b's until the step"
        b.res.step()
        b.res.writes.drain()
        assert blocks[4] not in held_by(pool, b)
        assert set(b.res.held) == set(blocks[:4])
    finally:
        a.close()
        b.close()
    assert books(pool.url)["in_use"] == 1  # only the null block


def test_a_step_asks_for_idle_blocks_ahead_of_need_so_that_later_allocs_find_them(pool: LocalPool) -> None:
    a = Engine(pool.url, "a")
    try:
        blocks = a.res.take(6)  # the first alloc fills the slab: 8 idle after it
        blocks += a.res.take(6)  # 2 left, `low`: no refill under the lock yet
        assert a.slab.num_idle == 2
        a.res.step()
        deadline = time.monotonic() + 10
        while a.slab.num_idle < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert a.slab.num_idle == 8, "refilled by the step, off the scheduler's thread"
        a.res.leave(blocks)
    finally:
        a.close()
    assert books(pool.url)["in_use"] == 1


def test_a_prefill_is_parked_by_id_and_its_decode_engine_claims_the_same_blocks(pool: LocalPool) -> None:
    p, d = Engine(pool.url, "prefill"), Engine(pool.url, "decode")
    try:
        prompt = list(range(3, 3 + 3 * BS + 2))
        blocks = p.res.take(4)
        p.compute(blocks[:3], prompt)
        p.res.park("p:r1", blocks, prompt, {"digest": "x"})
        p.res.leave(blocks)  # the prefill engine frees them at once; the handoff holds its own refs
        p.res.drain()
        d.res.prefetch("r1", prompt, claim="p:r1")
        hit = d.res.answer("r1")
        assert hit is not None and hit.num_tokens == 3 * BS and hit.meta == {"digest": "x"}
        got, _ = d.res.install("r1", hit, 3)
        assert got == blocks[:3] and holds(d.arena, got, prompt)
        assert p.res.counters.parked_requests == 1
    finally:
        p.close()
        d.close()
    assert books(pool.url)["in_use"] == 1


def test_a_claim_is_checked_and_trimmed_as_its_answer_is_read(pool: LocalPool) -> None:
    """The decode engine's handover does no per-block work the answer's thread could do: a handoff that holds
    another prompt's KV is released there, and so is the block of a prompt's last token, which vLLM computes."""
    p, d = Engine(pool.url, "prefill"), Engine(pool.url, "decode")
    try:
        prompt = list(range(7, 7 + 3 * BS))  # three full blocks: the last one's last token is computed again
        other = [1, *prompt[1:]]
        for key, tokens in (("p:same", prompt), ("p:other", other)):
            blocks = p.res.take(3)
            p.compute(blocks, tokens)
            p.res.park(key, blocks, tokens, {"digest": f"d{tokens[0]}"})
            p.res.leave(blocks)
        p.res.drain()
        d.res.block_objects = [f"block {b}" for b in range(N)]
        d.res.prefetch("same", prompt, claim="p:same", digest=f"d{prompt[0]}")
        d.res.prefetch("wrong", prompt, claim="p:other", digest=f"d{prompt[0]}")
        hit, wrong = d.res.answer("same"), d.res.answer("wrong")
        assert wrong is not None and not wrong.ids, "another prompt's KV is never installed"
        assert hit is not None and hit.claimed and hit.num_tokens == 3 * BS and len(hit.ids) == 2
        assert hit.found == [f"block {b}" for b in hit.blocks or []]
        got, _ = d.res.install("same", hit, len(hit.ids))
        assert holds(d.arena, got, prompt)
        d.res.drain()
        assert held_by(pool, d) == set(got), "the last block's ref and the wrong handoff's went back at once"
    finally:
        p.close()
        d.close()
    assert books(pool.url)["in_use"] == 1  # only the null block


def test_an_answer_for_a_request_that_left_goes_back(pool: LocalPool) -> None:
    a, b = Engine(pool.url, "a"), Engine(pool.url, "b")
    try:
        prompt = list(range(50, 50 + 2 * BS + 1))
        a.publish(prompt, 2)
        b.res.prefetch("gone", prompt)
        assert b.res.finished("gone") == []
        b.res.drain()
        b.res.drain()  # the answer's release went out on the writes thread after the answer came
        assert b.res.held == {}
        with PoolClient(pool.url, name="c") as c:
            c.free(c.alloc(books(pool.url)["free"] + books(pool.url)["cached"]))
    finally:
        a.close()
        b.close()


def test_answers_taken_or_given_back_leave_nothing_behind(pool: LocalPool) -> None:
    """An engine keeps an answer, and a claim's time, only until its request is installed or leaves: a claim the
    pool had nothing for, and a lookup whose request left, leave no entry in a process that runs for weeks."""
    a, b = Engine(pool.url, "a"), Engine(pool.url, "b")
    b.res.claim_timeout_s = 0.05
    try:
        prompt = list(range(70, 70 + 2 * BS + 1))
        a.publish(prompt, 2)
        b.res.prefetch("none", prompt, claim="a:never-parked")
        none = b.res.answer("none")
        assert none is not None and not none.ids, "nothing parked under that key"
        b.res.prefetch("left", prompt)
        b.res.drain()
        assert b.res.ready("left") is True, "the lookup was answered before its request left"
        b.res.finished("left")
        b.res.prefetch("hit", prompt)
        got, _ = b.res.install("hit", b.res.answer("hit"), 2)
        assert len(got) == 2
        assert "left" not in b.res.requests, "a request that left keeps no record"
        kept = [(r.answer, r.future, r.claim_us) for r in b.res.requests.values()]
        assert kept == [(None, None, None)] * len(kept)
        b.res.check_requests()
    finally:
        a.close()
        b.close()


def test_an_engine_learns_its_pool_stopped_from_its_heartbeat_with_no_call_of_its_own(pool: LocalPool) -> None:
    a = Engine(pool.url, "a")
    try:
        a.res.check()
        pool.stop()
        stopped = time.monotonic()
        with pytest.raises(PoolGone, match="the pool that owns this engine's KV memory is gone"):
            while time.monotonic() - stopped < 5.0:  # heartbeats every third of the 2 s lease
                a.res.check()
                time.sleep(0.05)
    finally:
        a.close()


def test_an_engine_whose_pool_stopped_takes_no_new_work(pool: LocalPool) -> None:
    a = Engine(pool.url, "a")
    try:
        a.res.take(2)
        pool.stop()
        with pytest.raises(PoolGone, match="Restart the pool, then restart the engine"):
            for _ in range(50):  # the first call that reaches for the pool finds it gone
                a.res.take(8)
                time.sleep(0.05)
        with pytest.raises(PoolGone):
            a.res.free_count()
    finally:
        a.close()


ENGINE = """
import sys, time
from tests.integrations.test_vllm_residency import Engine
e = Engine(sys.argv[1], "doomed")
e.res.take(20)
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_killed_engine_s_blocks_come_back_within_its_lease(pool_process: PoolProcess) -> None:
    pool = pool_process
    before = books(pool.url)["in_use"]
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, pool.url], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert books(pool.url)["in_use"] >= before + 20
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        while books(pool.url)["in_use"] > before:
            assert time.monotonic() - killed < 2.0 + 3.0, "the lease is 2 s; the sweep runs every second"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


def test_the_arena_a_resident_engine_writes_is_what_vllm_reads() -> None:
    """vLLM 0.26's TRITON_ATTN / FLASH_ATTN cache of a layer is [blocks, block_size, heads, 2 * head_dim] (K then
    V), viewed as [blocks, heads, block_size, 2 * head_dim]: the arena's k()/v() views name the same numbers."""
    raw = torch.zeros(N * LAYOUT.block_nbytes, dtype=torch.uint8)
    offset, size = LAYOUT.layer_region(N, 1)
    vllm = raw[offset : offset + size].view(torch.float32).view(N, BS, 2, 16).permute(0, 2, 1, 3)
    vllm.copy_(torch.randn_like(vllm))
    from kvpool.arena import Arena
    from kvpool.protocol import ArenaDescriptor

    desc = ArenaDescriptor(epoch="t", backend="cpu", device=None, handle="", handle_kind="shm", nbytes=raw.numel(),
                           num_blocks=N,
                           block_nbytes=LAYOUT.block_nbytes, layout=LAYOUT, owner_pid=0)  # fmt: skip
    arena = Arena(desc, raw)
    assert torch.equal(arena.k(1), vllm.permute(0, 2, 1, 3)[..., :8])
    assert torch.equal(arena.v(1), vllm.permute(0, 2, 1, 3)[..., 8:])


def test_calls_that_come_while_one_is_under_way_go_together_in_the_next() -> None:
    import threading

    from kvpool.integrations.vllm.batcher import Batcher

    gate, sizes = threading.Event(), []

    def run(items: list[int]) -> list[int]:
        sizes.append(len(items))
        if len(sizes) == 1:
            assert gate.wait(5)
        if 13 in items:
            raise RuntimeError("the pool is gone")
        return [i * 2 for i in items]

    batcher = Batcher("t", run, lambda exc: -1)
    try:
        first = batcher.submit(1)
        while not sizes:
            time.sleep(0.001)
        rest = [batcher.submit(i) for i in (2, 3, 4, 5)]
        gate.set()
        assert first.result(5) == 2 and [f.result(5) for f in rest] == [4, 6, 8, 10]
        assert sizes == [1, 4], "a burst that came during a call is one call, not four"
        assert batcher.submit(13).result(5) == -1, "a call that failed still answers every caller"
    finally:
        batcher.close()


def test_an_engine_on_the_second_arena_takes_its_blocks_and_hits_from_that_arena() -> None:
    """A pool of two arenas (one per GPU): an engine resident on the second takes its blocks from the second
    arena's slab (arena 1's block 0 is that arena's null block) and finds prefixes in that arena's chains."""
    proc = local_pool(*RESIDENT_POOL, "--devices", "0,1")
    try:
        made = []
        for name in ("a", "b"):
            client = SlabClient(proc.url, name=name, layout=LAYOUT, slab=SlabConfig(8, 2, 48, handoffs=False, device=1))
            slab = client.slab
            assert slab is not None
            res = Residency(client, BS, N, first_block=N, free_count=slab.idle_count, grow=slab.ensure_idle,
                            device=1)  # fmt: skip
            made.append((client, res))
        (_, a), (_, b) = made
        prompt = list(range(300, 300 + 3 * BS + 1))
        blocks = a.take(3)
        assert all(0 < x < N for x in blocks) and all(f & 0xFFFFFFFF >= N for f in a.held.values())
        a.commit(blocks, prompt[: 3 * BS])
        a.leave(blocks)
        a.drain()
        b.prefetch("r", prompt)
        hit = b.answer("r")
        assert hit is not None and b.install("r", hit, 3) == (blocks, [])
        for client, res in made:
            res.close()
            client.close()
    finally:
        proc.stop()


def test_a_prefill_parked_in_another_gpu_s_arena_is_computed_by_its_decode_engine_not_installed() -> None:
    """Prefill on GPU 0, decode on GPU 1: the claimed blocks are not in the decode engine's arena, so it gives them
    back and computes the prompt (never installs ids that name another GPU's memory); the books balance."""
    proc = local_pool(*RESIDENT_POOL, "--devices", "0,1")
    try:
        made = []
        for name, device in (("p", 0), ("d", 1)):
            client = SlabClient(
                proc.url, name=name, layout=LAYOUT, slab=SlabConfig(8, 2, 48, handoffs=False, device=device)
            )
            slab = client.slab
            assert slab is not None
            res = Residency(client, BS, N, first_block=N * device, free_count=slab.idle_count, grow=slab.ensure_idle,
                            device=device)  # fmt: skip
            made.append((client, res))
        (_, p), (_, d) = made
        prompt = list(range(7, 7 + 3 * BS + 2))
        blocks = p.take(4)
        p.park("p:r1", blocks, prompt, {})
        p.leave(blocks)
        p.drain()
        d.prefetch("r1", prompt, claim="p:r1")
        hit = d.answer("r1")
        assert hit is not None and hit.num_tokens == 0 and not hit.ids
        assert d.counters.foreign_handoffs == 1 and d.counters.installed_blocks == 0
        d.drain()
        for client, res in made:
            res.close()
            client.close()
        s = books(proc.url)
        assert s["free"] + s["in_use"] + s["cached"] == s["num_blocks"]
        assert s["in_use"] == 2, "only the two arenas' null blocks stay taken"
    finally:
        proc.stop()
