"""The vLLM connector's two sides against a real pool, without vLLM: engines are vLLM-shaped caches on the CPU."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from kvpool.client import PoolClient
from kvpool.errors import InvalidRequest
from kvpool.integrations.vllm.kvviews import kv_views
from kvpool.integrations.vllm.link import PoolLink
from kvpool.integrations.vllm.plan import Save, prompt_digest
from kvpool.integrations.vllm.saver import Job, Saver
from kvpool.integrations.vllm.scheduler import DIGEST_KEY, FROM_KEY, HANDOFF_KEY, Scheduled, SchedulerSide
from kvpool.integrations.vllm.settings import ConnectorSettings, layerwise_for
from kvpool.integrations.vllm.worker import WorkerSide
from kvpool.layout import KVLayout
from tests.conftest import SMALL_POOL, LocalPool, local_pool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
BS = LAYOUT.block_size
ENGINE_BLOCKS = 32


class Engine:
    """One engine's two connector sides and its paged cache, shaped as TRITON_ATTN shapes it."""

    def __init__(self, url: str, name: str, **settings: object) -> None:
        self.settings = ConnectorSettings(url=url, **settings)
        self.sched = SchedulerSide(PoolLink(url, f"{name}-s"), self.settings, BS, name, f"{name}-w")
        self.worker = WorkerSide(PoolLink(url, f"{name}-w"), LAYOUT, reserve=8)
        shape = (ENGINE_BLOCKS, LAYOUT.num_kv_heads, BS, 2 * LAYOUT.head_dim)
        self.caches = {f"model.layers.{i}.self_attn.attn": torch.randn(shape) for i in range(LAYOUT.num_layers)}
        self.worker.register(self.caches, lambda n: int(n.split(".")[2]))
        self.next_block = 1

    def blocks(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def step(self, req_id: str, prompt: list[int], blocks: list[int], computed: int, scheduled: int) -> None:
        """One engine step that computes ``scheduled`` tokens of the prompt (the forward writes random KV)."""
        plan = self.sched.build([Scheduled(req_id, computed, scheduled, blocks, True, prompt)])
        self.worker.load(plan)
        for cache in self.caches.values():  # the forward: writes the computed tokens' slots
            for pos in range(computed, computed + scheduled):
                cache[blocks[pos // BS], :, pos % BS] = torch.randn_like(cache[0, :, 0])
        self.worker.save(plan)
        self.worker.flush()

    def kv(self, blocks: list[int], num_tokens: int) -> list[torch.Tensor]:
        """K and V of the first ``num_tokens`` tokens held in ``blocks``, every layer."""
        out = []
        for name in sorted(self.caches):
            for t in kv_views(self.caches[name], LAYOUT):
                out.append(torch.cat([t[b] for b in blocks])[:num_tokens])
        return out

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


@pytest.fixture(scope="module")
def pool() -> Iterator[LocalPool]:
    proc = local_pool(*SMALL_POOL)
    yield proc
    proc.stop()


def stats(pool: LocalPool) -> dict:
    with PoolClient(pool.url, name="probe") as c:
        return c.stats()


def prompt_of(seed: int, n: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(e: Engine, req_id: str, prompt: list[int], params: dict | None = None) -> tuple[list[int], int]:
    """Schedule a request as vLLM does (match, allocate, one prefill step); its blocks and loaded token count."""
    ext = e.sched.match(req_id, prompt, 0, params)
    blocks = e.blocks(-(-len(prompt) // BS))
    e.sched.after_alloc(req_id, blocks, ext)
    e.step(req_id, prompt, blocks, ext, len(prompt) - ext)
    return blocks, ext


def test_second_engine_loads_the_prefix_the_first_computed(pool: LocalPool) -> None:
    a, b = Engine(pool.url, "a"), Engine(pool.url, "b")
    indexed = stats(pool)["indexed"]
    try:
        shared = prompt_of(1, 12)
        pa, pb = shared + prompt_of(2, 5), shared + prompt_of(3, 6)
        blocks_a, ext_a = serve(a, "r1", pa)
        assert ext_a == 0
        assert a.worker.saver.stats["saved_blocks"] == len(pa) // BS
        blocks_b, ext_b = serve(b, "r1", pb)
        assert ext_b == len(shared)
        assert b.worker.stats["loaded_blocks"] == len(shared) // BS
        for ka, kb in zip(a.kv(blocks_a, len(shared)), b.kv(blocks_b, len(shared)), strict=True):
            assert torch.equal(ka, kb)
        # b committed only its new full block; the shared prefix is held once
        assert b.worker.saver.stats["saved_blocks"] == len(pb) // BS - len(shared) // BS
        assert stats(pool)["indexed"] - indexed == len(pa) // BS + 1
    finally:
        a.close()
        b.close()


def test_a_hit_stops_one_token_short_and_counts_only_past_local_blocks(pool: LocalPool) -> None:
    a, b = Engine(pool.url, "a2"), Engine(pool.url, "b2")
    try:
        prompt = prompt_of(4, 16)
        serve(a, "r", prompt)
        assert b.sched.match("x", prompt, 0, None) == 12  # 16 tokens: the last block would leave nothing to compute
        assert b.sched.match("y", prompt, 8, None) == 4  # vLLM had two blocks locally
        assert b.sched.match("z", prompt, 12, None) == 0
    finally:
        a.close()
        b.close()


def test_prefill_engine_hands_a_request_to_the_decode_engine(pool: LocalPool) -> None:
    p, d = Engine(pool.url, "p"), Engine(pool.url, "d")
    try:
        prompt = prompt_of(5, 14)  # three full blocks and a partial one: the decode engine computes the last two
        blocks_p, _ = serve(p, "req", prompt, {"do_remote_decode": True})
        params = p.sched.finished("req")
        assert params is not None and params["num_tokens"] == 14 and params[FROM_KEY] == "p-w"
        assert len(params[HANDOFF_KEY]) >= 24 and "req" not in params[HANDOFF_KEY], "unguessable, names nobody"
        blocks_d, ext = serve(d, "other-id", prompt, params)
        assert ext == 12
        for kp, kd in zip(p.kv(blocks_p, 12), d.kv(blocks_d, 12), strict=True):
            assert torch.equal(kp, kd)
        assert stats(pool)["handoffs"] == 0
    finally:
        p.close()
        d.close()


def test_a_handoff_for_another_prompt_is_never_loaded(pool: LocalPool) -> None:
    p, d = Engine(pool.url, "p3"), Engine(pool.url, "d3")
    try:
        prompt = prompt_of(6, 10)
        serve(p, "req", prompt, {"do_remote_decode": True})
        params = p.sched.finished("req")
        assert params is not None
        other = [*prompt[:-1], prompt[-1] + 1]
        assert d.sched.match("r", other, 0, {**params, DIGEST_KEY: prompt_digest(other)}) == 0
        assert d.sched.reqs["r"].held == []
    finally:
        p.close()
        d.close()


def test_blocks_of_a_restarted_pool_fail_over_to_recompute(pool: LocalPool) -> None:
    a, b = Engine(pool.url, "a4"), Engine(pool.url, "b4")
    try:
        prompt = prompt_of(7, 9)
        serve(a, "r", prompt)
        ext = b.sched.match("r", prompt, 0, None)
        blocks = b.blocks(3)
        b.sched.after_alloc("r", blocks, ext)
        plan = b.sched.build([Scheduled("r", ext, len(prompt) - ext, blocks, True, prompt)])
        plan.epoch = "an-epoch-that-is-gone"
        b.worker.load(plan)
        assert b.worker.take_failed() == set(blocks[:2])
        assert b.worker.take_failed() == set()
    finally:
        a.close()
        b.close()


def test_an_unreachable_pool_means_no_hits_and_no_saves(tmp_path) -> None:
    e = Engine(f"unix://{tmp_path}/none.sock", "z")
    prompt = prompt_of(8, 9)
    _blocks, ext = serve(e, "r", prompt)
    assert ext == 0 and e.worker.saver is not None and e.worker.saver.stats["saved_blocks"] == 0
    assert e.sched.finished("r") is None
    e.close()


def test_refs_of_loaded_blocks_outlive_the_request_by_the_delay(pool: LocalPool) -> None:
    a, b = Engine(pool.url, "a5"), Engine(pool.url, "b5", free_delay_steps=2)
    try:
        prompt = prompt_of(9, 9)
        serve(a, "r", prompt)
        serve(b, "r", prompt)
        b.sched.finished("r")
        b.sched.drain()
        before = stats(pool)["in_use"]
        b.sched.build([])
        b.sched.drain()
        assert stats(pool)["in_use"] == before
        b.sched.build([])
        b.sched.drain()
        assert stats(pool)["in_use"] == before - 2
    finally:
        a.close()
        b.close()


def test_a_lookup_started_on_arrival_gives_what_a_lookup_at_scheduling_does(pool: LocalPool) -> None:
    a, b = Engine(pool.url, "a6"), Engine(pool.url, "b6")
    try:
        prompt = prompt_of(10, 13)
        serve(a, "r", prompt)
        before = stats(pool)["in_use"]
        b.sched.prefetch("gone", prompt, None)  # aborted before vLLM scheduled it
        b.sched.drain()  # the lookup took its refs
        assert stats(pool)["in_use"] == before + 3
        b.sched.finished("gone")
        b.sched.drain()
        assert stats(pool)["in_use"] == before
        b.sched.prefetch("x", prompt, None)
        assert b.sched.match("x", prompt, 0, None) == 12
    finally:
        a.close()
        b.close()


def test_a_save_past_a_prefix_evicted_meanwhile_commits_nothing_and_lets_go(pool: LocalPool) -> None:
    """The saver commits past the prefix the pool held at the match, in one call; if that prefix has gone since
    (its refs let go, then evicted), the chain has a gap: nothing is committed, and the new blocks go back."""
    with PoolClient(pool.url, name="probe") as c:
        saver = Saver(PoolLink(pool.url, "sv"), BS, reserve=4)
        try:
            saver.flush()
            before = stats(pool)
            held, gone = prompt_of(70, 12), prompt_of(71, 12)
            ids = c.alloc(2)
            c.commit(ids, held[:8])
            for prompt in (held, gone):  # ``gone``'s first two blocks were never in the pool
                new = saver.take(1)
                assert new is not None
                saver.submit(None, [Job(Save("r", prompt, [0, 1, 2], skip=2), skip=2, new=new)])
                saver.flush()
            assert c.lookup(held).num_tokens == 12 and c.lookup(gone).num_tokens == 0
            after = stats(pool)
            # the reserve gave 2 blocks and holds neither now; in use: ids, and the lookup's ref on held's tail
            assert after["in_use"] == before["in_use"] - 2 + 3
            assert after["indexed"] == before["indexed"] + 3 and saver.stats["saved_blocks"] == 1
        finally:
            saver.close()
            saver.link.close()  # the saver's session is its owner's (the worker's) to close


def test_a_steps_parked_prefills_go_in_a_write_each_and_a_gap_parks_nothing(pool: LocalPool) -> None:
    """Parked prefills: the held prefixes looked up, all committed, all parked; one whose prefix is gone is not
    parked, and its blocks go back."""
    with PoolClient(pool.url, name="dec") as decode, PoolClient(pool.url, name="probe2") as c:
        saver = Saver(PoolLink(pool.url, "sv2"), BS, reserve=8)
        try:
            saver.flush()
            fresh, held, gone = prompt_of(80, 9), prompt_of(81, 12), prompt_of(82, 12)
            ids = c.alloc(2)
            c.commit(ids, held[:8], release=True)
            jobs = []
            for i, (prompt, skip) in enumerate([(fresh, 0), (held, 2), (gone, 2)]):
                new = saver.take(len(prompt) // BS - skip)
                assert new is not None
                save = Save(f"r{i}", prompt, [], park=f"e:r{i}", digest=prompt_digest(prompt), skip=skip)
                jobs.append(Job(save, skip, new))
            before = stats(pool)["handoffs"]
            saver.submit(None, jobs)
            saver.flush()
            assert stats(pool)["handoffs"] == before + 2 and saver.stats["parked"] == 2
            got = decode.claim_many(["e:r0", "e:r1", "e:r2"], timeout_s=0.05)
            assert got[2] is None and [x.num_tokens for x in got[:2]] == [8, 12]
            assert got[1].block_ids[:2] == ids and got[1].block_ids[2:] == jobs[1].new
            assert got[0].meta == {"digest": prompt_digest(fresh)}
            decode.free([i for x in got[:2] for i in x.block_ids])
        finally:
            saver.close()
            saver.link.close()  # the saver's session is its owner's (the worker's) to close


def test_blocks_of_a_later_generation_are_copied_to_the_right_place(pool: LocalPool) -> None:
    """Ids carry their block's generation once a block has been reused: the copies must index the arena with the
    block alone, or every load after the first reuse would fail."""
    with PoolClient(pool.url, name="churn") as c:
        c.free(c.alloc(stats(pool)["free"]))  # every free block is recycled once: its next id has generation 1
    a, b = Engine(pool.url, "ga"), Engine(pool.url, "gb")
    try:
        shared = prompt_of(7, 12)
        blocks_a, _ = serve(a, "g1", shared + prompt_of(8, 5))
        with PoolClient(pool.url, name="probe") as c:
            hit = c.lookup(shared)
            assert hit.num_tokens == len(shared) and all(i >> 32 for i in hit.block_ids), "not a later generation"
            c.free(hit.block_ids)
        blocks_b, ext_b = serve(b, "g1", shared + prompt_of(9, 6))
        assert ext_b == len(shared) and b.worker.stats["load_failures"] == 0
        for ka, kb in zip(a.kv(blocks_a, len(shared)), b.kv(blocks_b, len(shared)), strict=True):
            assert torch.equal(ka, kb)
    finally:
        a.close()
        b.close()


def test_lookups_on_several_lanes_give_back_each_lanes_refs(pool: LocalPool) -> None:
    a, b = Engine(pool.url, "a9"), Engine(pool.url, "b9", lookup_threads=3, free_delay_steps=1)
    try:
        prompts = [prompt_of(20 + i, 13) for i in range(4)]
        for i, p in enumerate(prompts):
            serve(a, f"r{i}", p)
        before = stats(pool)["in_use"]
        for i, p in enumerate(prompts):  # one at a time: each batch of lookups goes out on the next lane
            b.sched.prefetch(f"x{i}", p, None)
            b.sched.drain()
        assert [b.sched.match(f"x{i}", p, 0, None) for i, p in enumerate(prompts)] == [12] * 4
        assert [b.sched.reqs[f"x{i}"].lane for i in range(4)] == [0, 1, 2, 0]
        assert stats(pool)["in_use"] == before + 12
        for i in range(4):
            b.sched.finished(f"x{i}")
        b.sched.build([])  # the delay of one step runs out: each lane frees its own refs
        b.sched.drain()
        assert stats(pool)["in_use"] == before
    finally:
        a.close()
        b.close()


def batch_sizes(e: Engine, kind: str) -> list[int]:
    """The sizes of the batched calls of ``kind`` (lookup, claim) that ``e``'s scheduler side sends from now on."""
    sizes: list[int] = []
    name = f"_{kind}_many"
    send = getattr(e.sched, name)

    def counted(client: object, batch: list, *rest: object) -> object:
        sizes.append(len(batch))
        return send(client, batch, *rest)

    setattr(e.sched, name, counted)
    return sizes


def arrive_together(e: Engine, prompts: list[list[int]], params: list[dict | None]) -> list[int]:
    """A burst: every request arrives while the lane is busy, then each is matched and let go; the tokens each
    matched."""
    gate = threading.Event()
    e.sched._lanes[0].submit(gate.wait, 30)
    try:
        for i, prompt in enumerate(prompts):
            e.sched.prefetch(f"x{i}", prompt, params[i])
    finally:
        gate.set()
    matched = [e.sched.match(f"x{i}", prompt, 0, params[i]) for i, prompt in enumerate(prompts)]
    for i in range(len(prompts)):
        e.sched.finished(f"x{i}")
    return matched


def test_the_lookups_of_a_burst_go_to_the_pool_in_one_call(pool: LocalPool) -> None:
    a, b = Engine(pool.url, "a10"), Engine(pool.url, "b10")
    try:
        prompts = [prompt_of(30 + i, 13) for i in range(5)]
        for i, p in enumerate(prompts[:4]):
            serve(a, f"r{i}", p)
        sizes = batch_sizes(b, "lookup")
        assert arrive_together(b, prompts, [None] * 5) == [12, 12, 12, 12, 0]
        assert sizes == [5]
    finally:
        a.close()
        b.close()


def test_an_engines_session_never_polls_for_answers(pool: LocalPool, monkeypatch) -> None:
    """Polling would keep the GIL from vLLM's threads: the connector's sessions sleep, whatever the environment."""
    monkeypatch.setenv("KVPOOL_REPLY_SPIN_US", "500")
    link = PoolLink(pool.url, "no-spin")
    try:
        assert link.open().transport.reply_spin_s == 0.0
    finally:
        link.client.close()  # type: ignore[union-attr]
    with PoolClient(pool.url, name="spins") as plain:
        assert plain.transport.reply_spin_s == 0.0005  # where nothing says otherwise, the environment counts


def test_loads_go_layer_by_layer_by_default_only_without_full_cuda_graphs() -> None:
    assert ConnectorSettings().layerwise is None
    assert layerwise_for(None, full_graphs=False) and not layerwise_for(None, full_graphs=True)
    assert layerwise_for(True, full_graphs=True) and not layerwise_for(False, full_graphs=False)


def test_a_key_the_connector_does_not_know_is_refused_naming_those_it_does() -> None:
    """Settings that were experiments are gone; an engine configured with one stops at start-up, saying so."""
    for gone in ("profile_dir", "switch_interval_ms", "lookup_wait_ms", "inline_when_idle"):
        with pytest.raises(InvalidRequest, match=f"kv_connector_extra_config.{gone}: .*known keys: url, token"):
            ConnectorSettings.parse({gone: 1})


def test_the_claims_of_a_burst_go_to_the_pool_in_one_call(pool: LocalPool) -> None:
    p, d = Engine(pool.url, "p11"), Engine(pool.url, "d11", claim_timeout_s=0.2)
    try:
        prompts = [prompt_of(40 + i, 13) for i in range(4)]
        params: list[dict | None] = []
        for i, prompt in enumerate(prompts):
            serve(p, f"r{i}", prompt, {"do_remote_decode": True})
            params.append(p.sched.finished(f"r{i}"))
        params[2] = {**(params[2] or {}), HANDOFF_KEY: "p11:never-parked"}
        parked = stats(pool)["handoffs"]
        sizes = batch_sizes(d, "claim")
        assert arrive_together(d, prompts, params) == [12, 12, 0, 12]
        assert sizes == [4]
        assert stats(pool)["handoffs"] == parked - 3  # r2's stays parked until its TTL: nobody asked for it
    finally:
        p.close()
        d.close()
