"""Resident mode under vLLM's own KV cache manager (needs vLLM, no GPU): two engines' managers over one pool, a
prefix one computed found by the other's own hit search in the same arena blocks, a slab that refills before the
manager says no, a prefill parked and claimed by id."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.core.kv_cache_manager", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request

from kvpool.integrations.vllm import blockpool
from kvpool.integrations.vllm.identity import EngineIdentity
from kvpool.integrations.vllm.resident import ResidentSchedulerSide
from tests.conftest import PoolProcess, start_pool
from tests.integrations.test_vllm_residency import BS, LAYOUT, RESIDENT_POOL, N, books, holds, stamp

HASH = get_hash_fn_by_name("sha256")
init_none_hash(HASH)
HASHER = get_request_block_hasher(BS, HASH)


class FakeClientEngine:
    """One engine's scheduler side as the connector builds it in resident mode, and vLLM's manager over it."""

    def __init__(self, url: str, name: str, slab_blocks: int = 8) -> None:
        from kvpool.slab import SlabClient, SlabConfig

        self.client = SlabClient(
            url, name=name, layout=LAYOUT, slab=SlabConfig(slab_blocks, slab_blocks // 4, 48, handoffs=False)
        )
        descriptor = self.client.descriptor()
        self.sched = ResidentSchedulerSide(self.client, descriptor, BS, 2.0, EngineIdentity({"model": "fake"}))
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=8, dtype=torch.float32)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.num_layers)]
        config = KVCacheConfig(N, [], [KVCacheGroupSpec(names, spec)])  # the manager reads no tensors
        self.manager = KVCacheManager(config, max_model_len=1024, scheduler_block_size=BS, hash_block_size=BS)
        self.sched.adopt(self.manager)  # what the connector's hook does on vLLM 0.29+ (0.26: built resident)
        assert isinstance(self.manager.block_pool, blockpool.ResidentBlockPool)
        self.arena = self.client.arena()

    def request(self, rid: str, prompt: list[int], params: dict | None = None) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=4), None, block_hasher=HASHER)
        req.kv_transfer_params = params
        self.sched.arrive(req)
        return req

    def schedule(self, req: Request) -> tuple[list[int], int]:
        """What vLLM's scheduler does for a waiting request: its hits, then its slots; returns its blocks and how
        many of its tokens were hits."""
        computed, hit_tokens, _ = self.manager.get_computed_blocks(req)
        deadline = time.monotonic() + 10
        while self.sched.deferred(req):  # vLLM leaves it waiting for a step: the pool's answer is on its way
            assert time.monotonic() < deadline, "the pool's answer never came"
            time.sleep(0.001)
            computed, hit_tokens, _ = self.manager.get_computed_blocks(req)
        new = self.manager.allocate_slots(req, req.num_tokens - hit_tokens, hit_tokens, computed)
        assert new is not None, "the manager placed the request"
        self.sched.after_alloc(req)
        req.num_computed_tokens = hit_tokens
        return list(self.manager.get_block_ids(req.request_id)[0]), hit_tokens

    def compute(self, blocks: list[int], prompt: list[int], first: int = 0) -> None:
        """The forward: each full block's KV is a function of its whole prefix, as real KV is."""
        for i in range(first, len(prompt) // BS):
            for layer in range(LAYOUT.num_layers):
                self.arena.k(layer)[blocks[i]].fill_(stamp(prompt, i))
                self.arena.v(layer)[blocks[i]].fill_(-stamp(prompt, i))

    def run(self, req: Request) -> list[int]:
        """Schedule, 'compute' what was not a hit, finish, free: the request's whole life in one engine."""
        blocks, hit = self.schedule(req)
        self.compute(blocks, list(req.prompt_token_ids), hit // BS)
        params = self.finish(req, blocks)
        return blocks if params is None else [params]  # type: ignore[list-item]

    def finish(self, req: Request, blocks: list[int]) -> dict | None:
        """The request's end as vLLM's scheduler has it: every token computed, the connector told, then vLLM frees
        its blocks; the calls to the pool that follow reach it before this returns."""
        req.num_computed_tokens = req.num_tokens
        params = self.sched.finished(req, blocks)
        self.manager.free(req)
        self.sched.residency.drain()
        return params

    def prefill(self, rid: str, prompt: list[int]) -> tuple[list[int], dict]:
        """A prefill engine's request: computed, finished with ``do_remote_decode`` (parked), freed; its blocks and
        the params that name the handoff."""
        req = self.request(rid, prompt, {"do_remote_decode": True})
        blocks, _ = self.schedule(req)
        self.compute(blocks, prompt)
        params = self.finish(req, blocks)
        assert params is not None and params["num_tokens"] == len(prompt)
        return blocks, params

    def close(self) -> None:
        self.sched.close()


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    proc = start_pool(*RESIDENT_POOL)
    yield proc
    proc.stop()


def hold_back_lookups(client: Any) -> threading.Event:
    """The pool's answers to this client's lookups wait until the returned event is set."""
    lookup_many, go = client.lookup_many, threading.Event()

    def held_back(*args: Any, **kwargs: Any) -> Any:
        go.wait(10)
        return lookup_many(*args, **kwargs)

    client.lookup_many = held_back
    return go


def test_a_prefix_another_engine_computed_is_the_request_s_hit_in_the_same_blocks(pool: PoolProcess) -> None:
    a = FakeClientEngine(pool.url, "a")
    b = FakeClientEngine(pool.url, "b")
    try:
        prompt = list(range(1000, 1000 + 5 * BS + 3))
        a_blocks = a.run(a.request("r1", prompt))
        assert 0 not in a_blocks
        req = b.request("r2", [*prompt[: 5 * BS], 7, 7, 7, 7, 7])
        blocks, hit = b.schedule(req)
        assert hit == 5 * BS and blocks[:5] == a_blocks[:5], "engine a's arena blocks"
        assert holds(b.arena, blocks[:5], prompt)
        assert b.sched.residency.counters.installed_blocks == 5 and b.sched.residency.counters.copied_blocks == 0
        b.finish(req, blocks)
        assert not b.sched.residency.held, "every block went back: the hits and its own full block to the pool"
    finally:
        a.close()
        b.close()
    assert books(pool.url)["in_use"] == 1


def test_where_vllm_s_hit_path_is_not_known_the_pool_s_hits_go_through_its_search_and_it_says_so(
    pool: PoolProcess, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A get_computed_blocks whose annotation resident mode does not know (another vLLM, or a profiler's wrapper
    without functools.wraps): the hit goes into vLLM's map and vLLM's own search finds it, in the same blocks."""
    monkeypatch.setattr(blockpool, "_ARITY", 0)
    a = FakeClientEngine(pool.url, "a")
    with caplog.at_level(logging.WARNING, logger="vllm.kvpool"):
        b = FakeClientEngine(pool.url, "b")
    try:
        assert "go through vLLM's own prefix search" in caplog.text
        prompt = list(range(3000, 3000 + 4 * BS + 3))
        a_blocks = a.run(a.request("r1", prompt))
        req = b.request("r2", [*prompt[: 4 * BS], 9, 9])
        blocks, hit = b.schedule(req)
        assert hit == 4 * BS and blocks[:4] == a_blocks[:4] and holds(b.arena, blocks[:4], prompt)
        assert b.manager.block_pool.blocks[blocks[0]].block_hash is not None, "found by vLLM's search, in its map"
        b.finish(req, blocks)
    finally:
        a.close()
        b.close()
    assert books(pool.url)["in_use"] == 1


def test_the_slab_refills_before_the_manager_says_no(pool: PoolProcess) -> None:
    a = FakeClientEngine(pool.url, "a", slab_blocks=4)
    a.sched._refill_ahead = lambda want: None  # no refill ahead as it arrives: the allocation finds the slab short
    try:
        prompt = list(range(30 * BS))
        blocks, _ = a.schedule(a.request("big", prompt))
        assert len(blocks) == 30 and a.sched.residency.counters.refills >= 1
    finally:
        a.close()


def test_a_prefill_is_parked_and_the_decode_engine_s_manager_takes_its_blocks(pool: PoolProcess) -> None:
    p = FakeClientEngine(pool.url, "prefill")
    d = FakeClientEngine(pool.url, "decode")
    try:
        prompt = list(range(500, 500 + 4 * BS + 2))
        blocks, params = p.prefill("r1", prompt)
        dreq = d.request("r1", prompt, params)
        got, hit = d.schedule(dreq)
        assert hit == 4 * BS and got[:4] == blocks[:4] and holds(d.arena, got[:4], prompt)
        # handed to vLLM as the request's hit (vLLM 0.26: no search, no map insert), and timed as the handover
        assert blockpool._ARITY == 3
        assert d.sched.residency.handovers.summary()["handovers"] == 1
        assert all(d.manager.block_pool.blocks[b].block_hash is None for b in got[:4])
        assert d.manager.block_pool.blocks[got[0]].ref_cnt == 1  # vLLM's own ref, taken as for any hit
        wrong = d.request("r2", [1, 2, 3, *prompt[3:]], params)  # a digest that does not match: nothing installed
        _, hit = d.schedule(wrong)
        assert hit == 0
    finally:
        p.close()
        d.close()


def test_a_hit_larger_than_the_slab_s_idle_blocks_is_scheduled(pool: PoolProcess) -> None:
    """vLLM asks room for a request's new blocks and for its hit blocks no request uses yet (its own pool keeps
    those among the free ones): the hits a waiting request holds count as free, or a handoff of more blocks than
    the slab keeps idle would never be scheduled."""
    p = FakeClientEngine(pool.url, "prefill")
    d = FakeClientEngine(pool.url, "decode")  # a slab of 8 idle blocks
    try:
        prompt = list(range(900, 900 + 12 * BS + 2))
        blocks, params = p.prefill("big", prompt)
        assert d.client.slab.idle_count() < 12
        got, hit = d.schedule(d.request("big", prompt, params))  # schedule() asserts the manager placed it
        assert hit == 12 * BS and got[:12] == blocks[:12] and holds(d.arena, got[:12], prompt)
        assert not d.manager.block_pool.waiting  # the request uses its hit now: nothing counted twice
    finally:
        p.close()
        d.close()


def test_a_lookup_s_hit_goes_on_with_blocks_this_engine_has_not_committed_yet(
    pool: PoolProcess,
) -> None:
    """The pool knows the prefix another engine committed; this engine's running request computed the next blocks,
    which only vLLM's own map knows: a new request's hit is both, as vLLM's own search would find it."""
    a, b = FakeClientEngine(pool.url, "a", slab_blocks=16), FakeClientEngine(pool.url, "b", slab_blocks=16)
    try:
        prompt = list(range(2000, 2000 + 6 * BS + 1))
        a.run(a.request("r1", prompt[: 3 * BS + 1]))  # a's 3 blocks, committed
        running = b.request("x", prompt)
        x_blocks, x_hit = b.schedule(running)  # a's 3 blocks, then 3 of its own, not committed while it runs
        assert x_hit == 3 * BS
        b.compute(x_blocks, prompt, 3)
        later = b.request("y", [*prompt[: 6 * BS], 5, 5])
        blocks, hit = b.schedule(later)
        assert hit == 6 * BS and blocks[:6] == x_blocks[:6], "the pool's three, then the engine's own three"
        assert holds(b.arena, blocks[:6], prompt)
        b.finish(later, blocks)
        b.finish(running, x_blocks)
    finally:
        a.close()
        b.close()
    assert books(pool.url)["in_use"] == 1


def test_a_request_whose_pool_answer_is_not_back_waits_a_step_while_the_others_go_on(pool: PoolProcess) -> None:
    """The scheduler never waits for the pool: a burst's first arrival would run alone while the rest queue."""
    a, b = FakeClientEngine(pool.url, "a"), FakeClientEngine(pool.url, "b")
    try:
        prompt = list(range(4000, 4000 + 3 * BS + 1))
        a.run(a.request("r1", prompt))
        go = hold_back_lookups(b.client)
        slow = b.request("slow", prompt)
        b.manager.get_computed_blocks(slow)
        assert b.sched.deferred(slow), "its answer is not back: vLLM leaves it waiting"
        assert not b.sched.deferred(slow), "told once a step"
        quick = b.request("quick", list(range(9000, 9000 + BS - 1)))  # under a block: nothing to ask the pool
        b.manager.get_computed_blocks(quick)
        assert not b.sched.deferred(quick)
        go.set()
        blocks, hit = b.schedule(slow)
        assert hit == 3 * BS and holds(b.arena, blocks[:3], prompt), "the next step took it in with its hit"
        b.finish(slow, blocks)
        b.finish(quick, [])
    finally:
        a.close()
        b.close()
    assert books(pool.url)["in_use"] == 1


def test_an_engine_s_slab_fills_as_it_starts_before_any_request(pool: PoolProcess) -> None:
    e = FakeClientEngine(pool.url, "e", slab_blocks=16)
    try:
        slab = e.client.slab
        assert slab is not None
        deadline = time.monotonic() + 10
        while slab.num_idle < 16 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slab.num_idle == 16, "the first burst's allocs find their blocks there"
    finally:
        e.close()
    assert books(pool.url)["in_use"] == 1
