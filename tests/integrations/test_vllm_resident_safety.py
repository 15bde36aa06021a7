"""Resident mode whatever vLLM is asked to do (issue 45), inside vLLM's own ``Scheduler`` on the CPU against a real
pool: requests keep their KV's identity, an engine that cannot prove its lease stops before it writes, a full arena
is a full cache, and what resident mode does not hold is refused or sent to copy mode at start-up. Needs vLLM."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from kvpool.client import PoolClient
from kvpool.errors import LayoutMismatch, PoolExhausted, UnknownSession
from kvpool.integrations.vllm import resident
from kvpool.integrations.vllm.identity import EngineIdentity
from kvpool.integrations.vllm.residency import PoolGone
from tests.conftest import PoolProcess
from tests.integrations.test_vllm_scheduler import (
    BS,
    HASH,
    HEAD_DIM,
    HEADS,
    LAYOUT,
    NAMES,
    config,
    resident_engine,
    resident_pool,
    tiny_llama,
)

NUM_BLOCKS = 48
PACKED = LAYOUT.model_copy(update={"order": "kv_packed"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    proc = resident_pool(NUM_BLOCKS)
    yield proc
    proc.stop()


def kv_config(spec: Any = None) -> KVCacheConfig:
    spec = spec or FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])


def engine(model_dir: Path, url: str, monkeypatch: pytest.MonkeyPatch, kv: KVCacheConfig | None = None,
           slab_blocks: int = 16, **extra: Any) -> Scheduler:  # fmt: skip
    """A resident engine's scheduler (the start-up check told that this CPU pool will do)."""
    cfg = config(model_dir, url)
    cls = resident_engine(cfg, monkeypatch)
    cfg.kv_transfer_config.kv_connector_extra_config.update(slab_blocks=slab_blocks, **extra)
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    return cls(cfg, kv or kv_config(), StructuredOutputManager(cfg), block_size=BS)


@contextlib.contextmanager
def running(model_dir: Path, url: str, monkeypatch: pytest.MonkeyPatch, **extra: Any) -> Iterator[Scheduler]:
    """A resident engine's scheduler for the ``with`` block, its connector shut down after."""
    sched = engine(model_dir, url, monkeypatch, **extra)
    try:
        yield sched
    finally:
        sched.connector.shutdown()  # type: ignore[union-attr]


def salt_of(model_dir: Path, url: str) -> str:
    """The salt an engine of this model salts its plain requests' chains with."""
    return EngineIdentity.of_config(config(model_dir, url)).salt


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kwargs: Any) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, prompt, sp, None, block_hasher=get_request_block_hasher(BS, HASH), **kwargs)


def step(sched: Scheduler) -> Any:
    """One schedule and a stand-in forward that samples token 7 for every request it ran."""
    out = sched.schedule()
    ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
    result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                               sampled_token_ids=[[7] for _ in ids])  # fmt: skip
    sched.update_from_output(out, result)
    side = getattr(sched.connector, "_resident_sched", None)
    if side is not None:
        side.residency.check_requests()  # each request's record as its phase allows, after every step
    return out


def writer_commits(url: str, prompt: list[int], salt: str | None) -> list[int]:
    """Another engine computed ``prompt``'s blocks and gave them to the pool under ``salt``."""
    with PoolClient(url, name="writer", layout=PACKED) as writer:
        ids = writer.alloc(len(prompt) // BS)
        writer.commit(ids, prompt, salt=salt)
        writer.free(ids)
    return ids


def committed_prefix(model_dir: Path, url: str, first: int, blocks: int) -> list[int]:
    """A prefix of ``blocks`` full blocks that another engine of this model computed and gave to the pool."""
    prefix = list(range(first, first + blocks * BS))
    writer_commits(url, prefix, salt_of(model_dir, url))
    return prefix


def first_hit(sched: Scheduler, request: Request) -> int:
    """Tokens the request starts with as computed, once its pool answer is back."""
    sched.add_request(request)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        out = step(sched)
        for new in out.scheduled_new_reqs:
            if new.req_id == request.request_id:
                return int(new.num_computed_tokens)
        time.sleep(0.01)
    raise AssertionError("never scheduled")


# -- requests keep their identity ----------------------------------------------------------------------------


def test_lora_and_salted_requests_never_start_with_base_model_kv(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 1: requests that arrive without word to the connector were looked up with no identity check."""
    prefix = committed_prefix(model_dir, pool.url, 100, 3)
    with running(model_dir, pool.url, monkeypatch) as sched:
        lora = LoRARequest("adapter", 1, "/adapters/a")
        assert first_hit(sched, req("lora", [*prefix, 1, 2], lora_request=lora)) == 0, "a LoRA request got base KV"
        assert first_hit(sched, req("salted", [*prefix, 1, 2], cache_salt="tenant-b")) == 0, "a salted one too"
        assert first_hit(sched, req("plain", [*prefix, 1, 2])) == 3 * BS, "a plain request still hits"


def test_requests_of_one_adapter_or_salt_share_with_each_other_across_engines(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keyed, not only kept out: what vLLM's own cache would share, the pool shares across engines."""
    prefix = list(range(400, 400 + 3 * BS))
    a, b = engine(model_dir, pool.url, monkeypatch), engine(model_dir, pool.url, monkeypatch)
    try:
        lora = LoRARequest("adapter", 1, "/adapters/a")
        for sched, rid in ((a, "a"), (b, "b")):  # a computes and finishes; b then finds it
            request = req(f"{rid}-lora", [*prefix, 1, 2], max_tokens=1, lora_request=lora)
            hit = first_hit(sched, request)
            if rid == "b":
                assert hit == 3 * BS, "the same adapter's KV is shared"
            sched.connector._resident_sched.residency.drain()  # type: ignore[union-attr]
        other = LoRARequest("other", 2, "/adapters/b")
        assert first_hit(b, req("b-other", [*prefix, 1, 2], lora_request=other)) == 0, "another adapter's is not"
    finally:
        a.connector.shutdown()  # type: ignore[union-attr]
        b.connector.shutdown()  # type: ignore[union-attr]


def test_prompt_embeds_and_multimodal_requests_are_kept_out() -> None:
    """Finding 2: placeholder token ids do not name the KV of embeddings or images."""
    ident = EngineIdentity({"model": "m"})
    plain = req("p", [1, 2, 3])
    embeds = req("e", [0, 0, 0], prompt_embeds=torch.zeros(3, 8))
    assert ident.of(plain) == ident.salt and ident.of(embeds) is None
    plain.mm_features = [object()]
    assert ident.of(plain) is None


def test_a_prompt_embeds_request_gets_no_kv_of_its_placeholder_ids(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 2, under vLLM's scheduler: the same placeholder ids over other embeddings are other KV."""
    prefix = committed_prefix(model_dir, pool.url, 200, 3)
    with running(model_dir, pool.url, monkeypatch) as sched:
        embeds = torch.zeros(len(prefix) + 2, 8)
        assert first_hit(sched, req("embeds", [*prefix, 1, 2], prompt_embeds=embeds)) == 0


def test_an_engine_with_other_rope_finds_none_of_another_engine_s_kv(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 4, under vLLM's scheduler: the pool started without --model, and two engines of one model name whose
    KV differs (a RoPE override here) do not share it."""
    prefix = committed_prefix(model_dir, pool.url, 500, 3)
    original = config

    def other_rope(*args: Any, **kwargs: Any) -> Any:
        cfg = original(*args, **kwargs)
        cfg.model_config.hf_config.rope_theta = 1234.0
        return cfg

    import tests.integrations.test_vllm_resident_safety as this

    monkeypatch.setattr(this, "config", other_rope)
    with running(model_dir, pool.url, monkeypatch) as sched:
        assert first_hit(sched, req("r", [*prefix, 1, 2])) == 0


def test_engines_share_only_interchangeable_kv(model_dir: Path) -> None:
    """Finding 4: with or without --model, what decides the KV is in every chain's salt."""
    url = "unix:///nowhere"
    base = EngineIdentity.of_config(config(model_dir, url)).salt
    assert base == EngineIdentity.of_config(config(model_dir, url)).salt, "the same engine, the same salt"
    other = config(model_dir, url)
    other.model_config.hf_config.rope_theta = 1234.0
    assert EngineIdentity.of_config(other).salt != base, "a RoPE override"
    other = config(model_dir, url)
    other.cache_config.cache_dtype = "fp8"
    assert EngineIdentity.of_config(other).salt != base, "another KV dtype"
    other = config(model_dir, url)
    other.cache_config.calculate_kv_scales = True
    assert EngineIdentity.of_config(other).salt != EngineIdentity.of_config(other).salt, "scales of its own"


def test_a_prefix_cache_reset_moves_the_engine_to_a_new_epoch(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 5: after a weight update (``reset_prefix_cache``) the pool's old KV is no hit, in both resets."""
    prefix = committed_prefix(model_dir, pool.url, 700, 3)
    with running(model_dir, pool.url, monkeypatch) as sched:
        assert sched.reset_prefix_cache(reset_connector=True)
        assert first_hit(sched, req("after", [*prefix, 1, 2])) == 0


# -- a fence, not a hope -------------------------------------------------------------------------------------


def test_an_engine_that_cannot_prove_its_lease_schedules_and_launches_nothing(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 3: a stall past the lease (no failed round trip to notice) stops the engine at its next step."""
    with running(model_dir, pool.url, monkeypatch) as sched:
        side = sched.connector._resident_sched  # type: ignore[union-attr]
        sched.add_request(req("r", list(range(3 * BS))))
        step(sched)
        monkeypatch.setattr(side.client.session, "proven_until", time.monotonic() - 1)
        with pytest.raises(PoolGone):
            sched.schedule()
        worker = resident.ResidentWorker.__new__(resident.ResidentWorker)
        worker.client = side.client
        with pytest.raises(PoolGone):
            worker.check()


def test_a_session_the_pool_no_longer_knows_is_a_lost_pool_not_a_raw_error(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 9: ``UnknownSession`` out of the slab stops the engine as ``PoolGone`` says."""
    with running(model_dir, pool.url, monkeypatch) as sched:
        side = sched.connector._resident_sched  # type: ignore[union-attr]

        def gone(*_: Any) -> Any:
            raise UnknownSession("this session's lease ran out")

        monkeypatch.setattr(side.client, "alloc", gone)
        monkeypatch.setattr(side.residency, "_free_count", lambda: 0)
        with pytest.raises(PoolGone):
            side.residency.take(1)


# -- a full arena is a full cache ------------------------------------------------------------------------------


def test_a_burst_that_needs_more_than_the_arena_finishes_without_an_error(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 7: with two engines on one small arena, vLLM preempts and waits as with its own cache; every
    request finishes, no exception comes out of ``schedule()``, and the books balance after."""
    with PoolClient(pool.url, name="books") as c:
        before = c.stats()["in_use"]
    a = engine(model_dir, pool.url, monkeypatch, slab_blocks=16)
    b = engine(model_dir, pool.url, monkeypatch, slab_blocks=16)
    try:
        shared = list(range(900, 900 + 2 * BS))
        for sched, tag in ((a, 0), (b, 1)):
            for i in range(8):  # 8 requests of 4 blocks and 16 decode tokens each engine: about twice the arena
                start = 1000 * (tag + 1) + 40 * i
                sched.add_request(req(f"{tag}-{i}", [*shared, *range(start, start + 2 * BS - 3)], max_tokens=16))
        deadline = time.monotonic() + 60
        while (a.has_requests() or b.has_requests()) and time.monotonic() < deadline:
            for sched in (a, b):
                if sched.has_requests():
                    step(sched)
        assert not a.has_requests() and not b.has_requests(), "every request finished"
    finally:
        for sched in (a, b):
            sched.connector._resident_sched.residency.drain()  # type: ignore[union-attr]
            sched.connector.shutdown()  # type: ignore[union-attr]
    with PoolClient(pool.url, name="books") as c:
        stats = c.stats()
    assert stats["in_use"] == before, f"blocks still held after every engine closed: {stats}"


def test_a_hit_stays_the_request_s_when_its_first_allocation_fails(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 7: vLLM asks again for a request it could not place; its pool hit is still there."""
    prefix = committed_prefix(model_dir, pool.url, 1300, 3)
    with running(model_dir, pool.url, monkeypatch) as sched:
        manager = sched.kv_cache_manager
        allocate, refused = manager.allocate_slots, []

        def once_refused(*args: Any, **kwargs: Any) -> Any:
            if not refused:
                refused.append(1)
                return None
            return allocate(*args, **kwargs)

        monkeypatch.setattr(manager, "allocate_slots", once_refused)
        assert first_hit(sched, req("r", [*prefix, 1, 2])) == 3 * BS and refused


# -- refused, or copy mode, at start-up -------------------------------------------------------------------------


def test_what_neither_mode_holds_is_refused_at_start_up(model_dir: Path, pool: PoolProcess) -> None:
    """Finding 8: sliding-window layers (and drafters) were accepted and crashed later."""
    cfg = config(model_dir, pool.url)
    spec = SlidingWindowSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32,
                             sliding_window=64)  # fmt: skip
    with pytest.raises(LayoutMismatch, match="sliding window"):
        Scheduler(cfg, kv_config(spec), StructuredOutputManager(cfg), block_size=BS)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda cfg: setattr(cfg.cache_config, "enable_prefix_caching", False), "prefix caching is off"),
        (lambda cfg: setattr(cfg.model_config, "enable_sleep_mode", True), "sleep mode"),
        (lambda cfg: setattr(cfg.kv_transfer_config, "kv_role", "kv_producer"), "kv_producer"),
    ],
    ids=["no-prefix-caching", "sleep-mode", "producer"],
)
def test_what_resident_mode_does_not_hold_runs_in_copy_mode_and_says_why(
    model_dir: Path, pool: PoolProcess, change: Any, why: str
) -> None:
    """Findings 5, 6, 7: sleep mode zeroes the arena, a producer frees blocks a step still writes, and without prefix
    caching a claim is never installed; each runs in copy mode instead, with one line saying why."""
    from kvpool.integrations.vllm.settings import why_not_resident

    cfg = config(model_dir, pool.url)
    cfg.kv_transfer_config.kv_connector_extra_config.update(mode="resident")
    change(cfg)
    assert why in (why_not_resident(cfg, "0.26.0") or "")
    assert "0.27.1" in (why_not_resident(config(model_dir, pool.url), "0.27.1") or ""), "an untested vLLM too"


def test_a_full_arena_preempts_and_waits_where_it_raised_and_the_waiting_hit_is_kept(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 7 at its cause: a waiting request's pinned hit counted as free for every allocation, so once the slab
    and the pool were dry a running request's next block came out of ``schedule()`` as ``PoolExhausted``."""
    prefix = committed_prefix(model_dir, pool.url, 1600, 4)
    sched = engine(model_dir, pool.url, monkeypatch, slab_blocks=16)
    hog = PoolClient(pool.url, name="hog", layout=PACKED)
    try:
        side = sched.connector._resident_sched  # type: ignore[union-attr]
        deadline = time.monotonic() + 10
        while side.client.slab.num_idle < 16 and time.monotonic() < deadline:  # the slab's first refill, ahead
            time.sleep(0.01)
        held: list[int] = []  # the rest of the arena is another engine's (a refill ahead may race the first ask)
        while (free := hog.stats()["free"]) > 0:
            with contextlib.suppress(PoolExhausted):
                held += hog.alloc(free)
        sched.add_request(req("runs", list(range(2000, 2000 + BS - 1)), max_tokens=30 * BS))
        step(sched)
        sched.add_request(req("waits", [*prefix, *range(3000, 3000 + 17 * BS)], max_tokens=2))
        seen: dict[str, int] = {}
        for _ in range(30 * BS):  # the running request outgrows the slab's 16 blocks: vLLM preempts, not raises
            out = step(sched)
            for new in out.scheduled_new_reqs:
                seen.setdefault(new.req_id, new.num_computed_tokens)
        assert "waits" not in seen, "no room for it while the arena is full"
        hog.free(held)
        deadline = time.monotonic() + 30
        while sched.has_requests() and time.monotonic() < deadline:
            out = step(sched)
            for new in out.scheduled_new_reqs:
                seen.setdefault(new.req_id, new.num_computed_tokens)
        assert not sched.has_requests(), "both finished once the arena had room"
        assert seen["waits"] == 4 * BS, "the waiting request's pool hit was kept for it"
    finally:
        hog.close()
        sched.connector.shutdown()  # type: ignore[union-attr]


def test_on_vllm_0_29_resident_mode_asks_for_kvpool_s_scheduler_class(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.29-0.30's connector never sees the KVCacheManager: without kvpool's scheduler class the engine runs in
    copy mode, and the line names the flag (0.29 told it was proven on a GPU, as the gate would say once it is)."""
    from kvpool.integrations.vllm import settings
    from kvpool.integrations.vllm.schedulers import ResidentAsyncScheduler

    monkeypatch.setattr(settings, "RESIDENT_VLLM", ("0.26.", "0.29."))
    cfg = config(model_dir, pool.url)
    cfg.kv_transfer_config.kv_connector_extra_config.update(mode="resident")
    why = settings.why_not_resident(cfg, "0.29.0") or ""
    assert "--scheduler-cls kvpool.integrations.vllm.ResidentAsyncScheduler" in why
    cfg.scheduler_config.scheduler_cls = ResidentAsyncScheduler
    assert settings.why_not_resident(cfg, "0.29.0") is None
    assert "proven on vLLM" in (settings.why_not_resident(cfg, "0.31.0") or ""), "0.31 not proven yet"
