"""The connector inside vLLM's own scheduler (CPU: no forward pass; the test writes the KV a forward would).

Needs vLLM; skipped without it (CI does not install it). Two engines, each a real ``vllm.v1`` Scheduler with the
connector loaded through ``kv_connector_module_path``, and a worker-side connector over vLLM-shaped CPU caches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")

from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvpool.errors import LayoutMismatch  # noqa: E402
from kvpool.integrations.vllm.connector import KvpoolConnector  # noqa: E402
from kvpool.integrations.vllm.kvviews import kv_views  # noqa: E402
from kvpool.layout import KVLayout  # noqa: E402
from tests.conftest import PoolProcess, start_pool  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BS, NUM_BLOCKS = 2, 2, 16, 16, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LAYOUT = KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=BS, dtype="float32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def tiny_llama(d: Path) -> Path:
    """A model directory vLLM's config reads (no weights: nothing runs a forward here)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HEADS * 2 * HEAD_DIM,
        "intermediate_size": 128, "num_attention_heads": HEADS * 2, "num_key_value_heads": HEADS,
        "num_hidden_layers": LAYERS, "vocab_size": 1000, "max_position_embeddings": 512, "head_dim": HEAD_DIM,
        "torch_dtype": "float32", "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    }  # fmt: skip
    (d / "config.json").write_text(json.dumps(config))
    return d


def resident_pool(num_blocks: int) -> PoolProcess:
    """A pool that resident engines of :func:`tiny_llama` run in: a kv_packed arena of ``num_blocks`` blocks, all of
    which one engine's slab may hold."""
    return start_pool("--num-blocks", str(num_blocks), "--num-layers", str(LAYERS), "--num-kv-heads", str(HEADS),
                      "--head-dim", str(HEAD_DIM), "--block-size", str(BS), "--dtype", "float32", "--order",
                      "kv_packed", "--slabs", "--slab-max-blocks", str(num_blocks))  # fmt: skip


@pytest.fixture(scope="module")
def pool() -> Iterator[PoolProcess]:
    flags = ["--num-blocks", "128", "--num-layers", str(LAYERS), "--num-kv-heads", str(HEADS),
             "--head-dim", str(HEAD_DIM), "--block-size", str(BS), "--dtype", "float32"]  # fmt: skip
    proc = start_pool(*flags)
    yield proc
    proc.stop()


def config(model_dir: Path, url: str, block_size: int = BS) -> VllmConfig:
    transfer = KVTransferConfig(
        kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.integrations.vllm", kv_role="kv_both",
        kv_load_failure_policy="recompute", kv_connector_extra_config={"url": url, "reserve_blocks": 16},
    )  # fmt: skip
    return VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=512),
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=512, max_model_len=512, is_encoder_decoder=False
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=transfer,
    )


def resident_engine(cfg: VllmConfig, monkeypatch: pytest.MonkeyPatch) -> type[Scheduler]:
    """Let ``cfg``'s engine be resident on this CPU and this vLLM (its start-up checks told that the CPU pool will
    do, and that this vLLM was proven on a GPU); returns the scheduler class it runs under on this vLLM's
    generation (its own, or kvpool's where the connector alone cannot make it resident)."""
    import vllm

    from kvpool.integrations.vllm import generations, resident, settings
    from kvpool.integrations.vllm.schedulers import ResidentScheduler

    monkeypatch.setattr(settings, "RESIDENT_VLLM", (vllm.__version__,))
    monkeypatch.setattr(resident, "why_not", lambda *args: None)
    monkeypatch.setattr(resident, "arena_on", lambda descriptor, uuid: descriptor)
    cfg.kv_transfer_config.kv_connector_extra_config.update(mode="resident")
    if generations.current().HOOK != "scheduler_cls":
        return Scheduler
    cfg.scheduler_config.scheduler_cls = ResidentScheduler
    return ResidentScheduler


def triton_cache() -> torch.Tensor:
    """A layer's cache allocated as vLLM's GPU model runner does for TRITON_ATTN (physical order, then permuted)."""
    shape = TritonAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, BS, HEADS, HEAD_DIM)
    order = TritonAttentionBackend.get_kv_cache_stride_order()
    physical = torch.randn([shape[i] for i in order])
    return physical.permute(*[order.index(i) for i in range(len(order))])


def engine_caches() -> dict[str, torch.Tensor]:
    """Each layer's cache as this vLLM's GPU worker allocates it: per layer in the attention backend's shape before
    0.29; from 0.29 views of one backing, cut by vLLM's own ``allocate_kv_cache`` from its own plan (default layout)."""
    if hasattr(TritonAttentionBackend, "get_kv_cache_shape"):
        return {n: triton_cache() for n in NAMES}
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from tests.integrations.test_vllm_memory import vllm_plan

    plan = vllm_plan(LAYOUT, "LBNHC", NUM_BLOCKS)
    return allocate_kv_cache(plan, torch.device("cpu"), KVCacheLayout.LBNHC)


class Engine:
    def __init__(self, cfg: VllmConfig) -> None:
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
        cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
        self.sched = Scheduler(cfg, kv, StructuredOutputManager(cfg), block_size=BS)
        self.worker = KvpoolConnector(cfg, KVConnectorRole.WORKER, kv)
        with set_current_vllm_config(cfg):
            self.caches = engine_caches()
        self.worker.register_kv_caches(self.caches)

    def step(self) -> dict[str, tuple[list[int], int, int]]:
        """One schedule and a stand-in forward; per request: its blocks, computed before, scheduled now."""
        out = self.sched.schedule()
        self.worker.bind_connector_metadata(out.kv_connector_metadata)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]
        seen = {}
        for r in out.scheduled_new_reqs:
            n = out.num_scheduled_tokens[r.req_id]
            for cache in self.caches.values():
                k, v = kv_views(cache, LAYOUT)
                for pos in range(r.num_computed_tokens, r.num_computed_tokens + n):
                    k[r.block_ids[0][pos // BS], pos % BS] = torch.randn(HEADS, HEAD_DIM)
                    v[r.block_ids[0][pos // BS], pos % BS] = torch.randn(HEADS, HEAD_DIM)
            seen[r.req_id] = (list(r.block_ids[0]), r.num_computed_tokens, n)
        self.worker.wait_for_save()
        self.worker.flush()
        self.worker.clear_connector_metadata()
        return seen

    def kv(self, blocks: list[int], num_tokens: int) -> list[torch.Tensor]:
        out = []
        for cache in self.caches.values():
            for t in kv_views(cache, LAYOUT):
                out.append(torch.cat([t[b] for b in blocks])[:num_tokens])
        return out

    def close(self) -> None:
        self.sched.connector.shutdown()
        self.worker.shutdown()


HASH = get_hash_fn_by_name("sha256")
init_none_hash(HASH)


def request(req_id: str, prompt: list[int], params: dict | None = None) -> Request:
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params else None)
    return Request(req_id, prompt, sp, None, block_hasher=get_request_block_hasher(BS, HASH))


def prompt_of(seed: int, n: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_vllm_schedules_the_prefix_another_engine_computed(model_dir: Path, pool: PoolProcess) -> None:
    a, b = Engine(config(model_dir, pool.url)), Engine(config(model_dir, pool.url))
    try:
        shared = prompt_of(1, 3 * BS)
        pa, pb = shared + prompt_of(2, 20), shared + prompt_of(3, 9)
        a.sched.add_request(request("a1", pa))
        blocks_a, computed_a, _ = a.step()["a1"]
        assert computed_a == 0
        b.sched.add_request(request("b1", pb))
        blocks_b, computed_b, scheduled_b = b.step()["b1"]
        assert (computed_b, scheduled_b) == (len(shared), len(pb) - len(shared))
        for ka, kb in zip(a.kv(blocks_a, len(shared)), b.kv(blocks_b, len(shared)), strict=True):
            assert torch.equal(ka, kb)
    finally:
        a.close()
        b.close()


def test_vllm_hands_a_prefill_to_a_decode_engine(model_dir: Path, pool: PoolProcess) -> None:
    p, d = Engine(config(model_dir, pool.url)), Engine(config(model_dir, pool.url))
    try:
        prompt = prompt_of(4, 2 * BS + 5)
        req = request("p1", prompt, {"do_remote_decode": True})
        p.sched.add_request(req)
        blocks_p, _, _ = p.step()["p1"]
        _, params = p.sched.connector.request_finished(req, blocks_p)
        assert params is not None
        d.sched.add_request(request("d1", prompt, params))
        blocks_d, computed_d, scheduled_d = d.step()["d1"]
        assert (computed_d, scheduled_d) == (2 * BS, 5)  # full blocks, as vLLM's own prefix cache would give
        for kp, kd in zip(p.kv(blocks_p, 2 * BS), d.kv(blocks_d, 2 * BS), strict=True):
            assert torch.equal(kp, kd)
    finally:
        p.close()
        d.close()


def test_a_lookup_starts_when_the_engine_core_decodes_the_request(model_dir: Path, pool: PoolProcess) -> None:
    """vLLM's own ``preprocess_add_request``, wrapped as the connector wraps it, on a stand-in engine core: the
    lookup is under way before the scheduler has the request, and scheduling it asks the pool nothing more."""
    from types import SimpleNamespace

    from kvpool.integrations.vllm import generations

    if generations.current().HOOK != "patch":
        pytest.skip("from vLLM 0.29 no hook reaches the engine core's input thread without a patch: no early lookups")

    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.preprocess_add_request
    a, b = Engine(config(model_dir, pool.url)), Engine(config(model_dir, pool.url))
    try:
        shared = prompt_of(5, 3 * BS)
        a.sched.add_request(request("a1", shared + prompt_of(6, 7)))
        a.step()
        core = SimpleNamespace(scheduler=b.sched, mm_receiver_cache=None, structured_output_manager=None,
                               request_block_hasher=get_request_block_hasher(BS, HASH))  # fmt: skip
        prompt = shared + prompt_of(7, 9)
        sent = EngineCoreRequest("b1", prompt, None, SamplingParams(max_tokens=4), None, 0.0, None, None, None)
        lookups = pool.stats()["counters"]["lookup_requests"]
        req, _ = EngineCore.preprocess_add_request(core, sent)  # type: ignore[arg-type]
        b.sched.connector._sched.drain()
        assert pool.stats()["counters"]["lookup_requests"] == lookups + 1
        b.sched.add_request(req)
        _, computed, scheduled = b.step()["b1"]
        assert (computed, scheduled) == (len(shared), len(prompt) - len(shared))
        assert pool.stats()["counters"]["lookup_requests"] == lookups + 1
        pooling = SimpleNamespace(request_id="e1", prompt_token_ids=prompt, pooling_params=object())
        b.sched.connector.on_arrival(pooling)  # vLLM may refuse it before scheduling: no refs taken for it
        b.sched.connector._sched.drain()
        assert pool.stats()["counters"]["lookup_requests"] == lookups + 1
    finally:
        EngineCore.preprocess_add_request = original
        a.close()
        b.close()


def test_with_early_lookup_off_a_lookup_waits_for_the_scheduler(model_dir: Path, pool: PoolProcess) -> None:
    cfg = config(model_dir, pool.url)
    cfg.kv_transfer_config.kv_connector_extra_config["early_lookup"] = False
    e = Engine(cfg)
    try:
        prompt = prompt_of(8, 3 * BS)
        lookups = pool.stats()["counters"]["lookup_requests"]
        e.sched.connector.on_arrival(request("e1", prompt))
        e.sched.connector._sched.drain()
        assert pool.stats()["counters"]["lookup_requests"] == lookups
        e.sched.add_request(request("e1", prompt))  # on_new_request: the lookup starts now
        e.sched.connector._sched.drain()
        assert pool.stats()["counters"]["lookup_requests"] == lookups + 1
    finally:
        e.close()


def test_an_engine_that_does_not_fit_the_pool_is_refused_naming_the_flag(model_dir: Path, pool: PoolProcess) -> None:
    with pytest.raises(LayoutMismatch, match="--block-size 32"):
        cfg = config(model_dir, pool.url, block_size=32)
        KvpoolConnector(cfg, KVConnectorRole.SCHEDULER, KVCacheConfig(0, [], []))


def test_full_cuda_graphs_are_kept_unless_layerwise_loads_are_asked_for() -> None:
    assert not KvpoolConnector.requires_piecewise_for_cudagraph({})
    assert not KvpoolConnector.requires_piecewise_for_cudagraph({"layerwise": False})
    assert KvpoolConnector.requires_piecewise_for_cudagraph({"layerwise": True})
