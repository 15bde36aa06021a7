"""Resident mode's scheduler side inside vLLM's own ``Scheduler`` (CPU: resident mode needs the arena on a GPU, so
its start-up check is told this CPU pool will do; the scheduler side never touches KV bytes). Needs vLLM; skipped
without it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.structured_output import StructuredOutputManager

from kvpool.client import PoolClient
from kvpool.integrations.vllm import resident
from kvpool.integrations.vllm.identity import EngineIdentity
from tests.conftest import PoolProcess
from tests.integrations.test_vllm_blockpool import hold_back_lookups
from tests.integrations.test_vllm_scheduler import (
    BS,
    HEAD_DIM,
    HEADS,
    LAYOUT,
    NAMES,
    config,
    request,
    resident_engine,
    resident_pool,
    tiny_llama,
)

NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    proc = resident_pool(NUM_BLOCKS)
    yield proc
    proc.stop()


def resident_scheduler(model_dir: Path, url: str, monkeypatch: pytest.MonkeyPatch) -> Scheduler:
    cfg = config(model_dir, url)
    cls = resident_engine(cfg, monkeypatch)
    cfg.kv_transfer_config.kv_connector_extra_config.update(slab_blocks=16)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    sched = cls(cfg, kv, StructuredOutputManager(cfg), block_size=BS)
    assert sched.connector is not None and sched.connector._resident_sched is not None, "resident mode started"
    return sched


def test_vllm_leaves_a_request_whose_pool_answer_is_not_back_waiting_and_schedules_the_others(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = list(range(100, 100 + 3 * BS))
    packed = LAYOUT.model_copy(update={"order": "kv_packed"})
    with PoolClient(pool.url, name="writer", layout=packed) as writer:  # another engine computed the prefix
        ids = writer.alloc(3)
        writer.commit(ids, prefix, salt=EngineIdentity.of_config(config(model_dir, pool.url)).salt)
        writer.free(ids)
    sched = resident_scheduler(model_dir, pool.url, monkeypatch)
    try:
        side = sched.connector._resident_sched  # type: ignore[union-attr]
        go = hold_back_lookups(side.client)
        searched: list[int] = []
        coordinator = sched.kv_cache_manager.coordinator
        find = coordinator.find_longest_cache_hit
        monkeypatch.setattr(coordinator, "find_longest_cache_hit", lambda *a: searched.append(1) or find(*a))
        sched.add_request(request("slow", [*prefix, 7, 8, 9]))
        first = sched.schedule()
        assert not first.scheduled_new_reqs and not searched, "left waiting, and not searched for in vain"
        sched.add_request(request("quick", [5] * (BS - 2)))  # under a block: nothing to ask the pool
        first = sched.schedule()
        assert [r.req_id for r in first.scheduled_new_reqs] == ["quick"], "the scheduler did not wait for the pool"
        go.set()
        side.residency._lookups.drain()
        second = sched.schedule()
        [slow] = second.scheduled_new_reqs
        assert slow.req_id == "slow" and slow.num_computed_tokens == 3 * BS, "taken in the next step, with its hit"
        assert list(slow.block_ids[0][:3]) == [i & 0xFFFFFFFF for i in ids], "the writer's arena blocks"
    finally:
        sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_request_s_resident_state_is_one_record_through_its_life(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arrived (its answer on the way, left waiting) -> answered (its hit installed and pinned) -> running (placed,
    nothing pinned) -> released (finished: the record, and with it all the engine kept for it, gone); the records
    are checked against their phases after every step."""
    from vllm.v1.request import RequestStatus

    from kvpool.integrations.vllm.residentrequest import Phase

    prefix = list(range(500, 500 + 2 * BS))
    packed = LAYOUT.model_copy(update={"order": "kv_packed"})
    with PoolClient(pool.url, name="writer", layout=packed) as writer:
        ids = writer.alloc(2)
        writer.commit(ids, prefix, salt=EngineIdentity.of_config(config(model_dir, pool.url)).salt)
        writer.free(ids)
    sched = resident_scheduler(model_dir, pool.url, monkeypatch)
    try:
        side = sched.connector._resident_sched  # type: ignore[union-attr]
        res = side.residency
        go = hold_back_lookups(side.client)
        sched.add_request(request("r", [*prefix, 1, 2, 3]))
        assert not sched.schedule().scheduled_new_reqs
        res.check_requests()
        rec = res.requests["r"]
        assert (rec.phase, rec.since is not None, rec.future is not None) == (Phase.ARRIVED, True, True), "left waiting"
        go.set()
        res._lookups.drain()
        [placed] = sched.schedule().scheduled_new_reqs
        res.check_requests()
        assert placed.num_computed_tokens == 2 * BS
        assert res.requests["r"] is rec, "one record, from arrival on"
        assert (rec.phase, rec.pins, rec.installed, rec.future, rec.answer) == (Phase.RUNNING, None, None, None, None)
        assert rec.asked_at == 0 and not res.pins, "asked once, nothing pinned once placed"
        with pytest.raises(AssertionError, match="cannot go from running to answered"):
            rec.to(Phase.ANSWERED)
        sched.finish_requests("r", RequestStatus.FINISHED_ABORTED)
        res.check_requests()
        assert res.requests == {}, "a request that left keeps nothing"
    finally:
        sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_request_whose_answer_comes_within_the_brief_wait_is_taken_in_the_same_step(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone request is not put off a step for an answer that is nearly there (here the wait is made long enough
    for any machine's round trip)."""
    prefix = list(range(300, 300 + 2 * BS))
    packed = LAYOUT.model_copy(update={"order": "kv_packed"})
    with PoolClient(pool.url, name="writer", layout=packed) as writer:
        ids = writer.alloc(2)
        writer.commit(ids, prefix, salt=EngineIdentity.of_config(config(model_dir, pool.url)).salt)
        writer.free(ids)
    monkeypatch.setattr(resident, "ANSWER_WAIT_S", 10.0)
    sched = resident_scheduler(model_dir, pool.url, monkeypatch)
    try:
        sched.add_request(request("lone", [*prefix, 1, 2, 3]))
        [lone] = sched.schedule().scheduled_new_reqs
        assert lone.num_computed_tokens == 2 * BS
    finally:
        sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_step_waits_for_answers_once_not_once_a_request(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst's answers come back together: each of its requests waiting in turn would hold the step that many
    times over."""
    monkeypatch.setattr(resident, "ANSWER_WAIT_S", 0.5)
    sched = resident_scheduler(model_dir, pool.url, monkeypatch)
    try:
        side = sched.connector._resident_sched  # type: ignore[union-attr]
        go = hold_back_lookups(side.client)
        ready, waits = side.residency.ready, []

        def timed(rid: str, wait_s: float = 0.0) -> bool | None:
            waits.append(wait_s)
            return ready(rid, wait_s)

        monkeypatch.setattr(side.residency, "ready", timed)
        for i in range(3):
            sched.add_request(request(f"r{i}", list(range(10 * i, 10 * i + 3 * BS))))
        assert not sched.schedule().scheduled_new_reqs, "all three left waiting"
        assert sum(waits) < 0.75, f"the step waited {waits}: once in all, not once a request"
        counted = sum(side.residency.handovers.wait_us) / 1e6
        assert 0.4 < counted < 0.75, f"the step's wait is counted where the engine reports its waits ({counted} s)"
        waits.clear()
        assert not sched.schedule().scheduled_new_reqs and not any(waits), "a request waits in its first step only"
        go.set()
        side.residency._lookups.drain()
        assert len(sched.schedule().scheduled_new_reqs) == 3
    finally:
        sched.connector.shutdown()  # type: ignore[union-attr]


def test_vllm_s_async_scheduler_runs_resident_too(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's default with async scheduling is its ``AsyncScheduler``: its block pool becomes resident the same way
    (through the connector from vLLM 0.30, kvpool's ``ResidentAsyncScheduler`` on 0.29), and a prefix another
    engine computed is its hit."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from kvpool.integrations.vllm import blockpool
    from kvpool.integrations.vllm.schedulers import ResidentAsyncScheduler, ResidentScheduler

    prefix = list(range(700, 700 + 2 * BS))
    packed = LAYOUT.model_copy(update={"order": "kv_packed"})
    with PoolClient(pool.url, name="writer", layout=packed) as writer:
        ids = writer.alloc(2)
        writer.commit(ids, prefix, salt=EngineIdentity.of_config(config(model_dir, pool.url)).salt)
        writer.free(ids)
    cfg = config(model_dir, pool.url)
    cls = resident_engine(cfg, monkeypatch)
    cls = ResidentAsyncScheduler if cls is ResidentScheduler else AsyncScheduler
    cfg.kv_transfer_config.kv_connector_extra_config.update(slab_blocks=16)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    sched = cls(cfg, kv, StructuredOutputManager(cfg), block_size=BS)
    try:
        assert isinstance(sched.kv_cache_manager.block_pool, blockpool.ResidentBlockPool)
        sched.add_request(request("async", [*prefix, 1, 2, 3]))
        deadline = time.monotonic() + 30
        while not (out := sched.schedule()).scheduled_new_reqs and time.monotonic() < deadline:
            time.sleep(0.01)  # its answer is on the way: left waiting this step
        [taken] = out.scheduled_new_reqs
        assert taken.num_computed_tokens == 2 * BS and list(taken.block_ids[0][:2]) == [i & 0xFFFFFFFF for i in ids]
    finally:
        sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_decode_step_proves_the_lease_once_not_once_a_running_request(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM counts the free blocks once for every running request in every step; the lease is proven once a step
    (and by every take, and before every launch), not with each count: 64 proofs a decode step were a tenth of the
    resident scheduler's step on the CPU."""
    from tests.integrations.test_vllm_resident_safety import step

    sched = resident_scheduler(model_dir, pool.url, monkeypatch)
    try:
        side = sched.connector._resident_sched  # type: ignore[union-attr]
        for i in range(6):
            sched.add_request(request(f"d{i}", list(range(40 * i, 40 * i + BS - 4))))  # no full block: no lookup
        deadline = time.monotonic() + 30
        while len(sched.running) < 6 and time.monotonic() < deadline:
            step(sched)
        assert len(sched.running) == 6
        alive, proofs = side.residency._alive, []
        monkeypatch.setattr(side.residency, "_alive", lambda: proofs.append(1) or alive())
        out = step(sched)
        assert len(out.scheduled_cached_reqs.req_ids) == 6, "a decode step of the six"
        assert len(proofs) == 1, f"the lease was proven {len(proofs)} times in one step"
    finally:
        sched.connector.shutdown()  # type: ignore[union-attr]


def test_a_burst_bigger_than_the_slab_is_refilled_for_as_it_arrives_not_on_the_scheduler_s_thread(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight prompts of three blocks each, on a 16-block slab: their allocs in one step used to run the slab dry and
    wait for a refill round trip under the slab's lock, on the scheduler's thread. Asked for as they arrive, the
    blocks are there."""
    import threading

    from kvpool.slab import reservation

    monkeypatch.setattr(resident, "ANSWER_WAIT_S", 10.0)  # all eight taken in one step, whatever the machine
    sched = resident_scheduler(model_dir, pool.url, monkeypatch)
    try:
        side = sched.connector._resident_sched  # type: ignore[union-attr]
        slab = side.client.slab
        fetch, on_scheduler = reservation.Slab._fetch, []

        def counted(self: reservation.Slab, take: int) -> Any:
            if threading.current_thread() is threading.main_thread():
                on_scheduler.append(take)
            return fetch(self, take)

        monkeypatch.setattr(reservation.Slab, "_fetch", counted)
        for i in range(8):
            sched.add_request(request(f"b{i}", list(range(50 * i, 50 * i + 2 * BS + 5))))
        need = 8 * ((2 * BS + 5) // BS + 1)
        deadline = time.monotonic() + 30  # the refill the arrivals asked for, once their lookups answered
        while (slab.num_idle < need or slab._topping) and time.monotonic() < deadline:
            time.sleep(0.01)
        out = sched.schedule()
        assert len(out.scheduled_new_reqs) == 8
        assert not on_scheduler, f"the scheduler's thread waited for {len(on_scheduler)} refills"
    finally:
        sched.connector.shutdown()  # type: ignore[union-attr]
