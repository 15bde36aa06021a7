"""``KvpoolConnector``: vLLM's KV connector API (v1) on kvpool's scheduler and worker sides.

vLLM builds one instance per role in the engine's processes: the scheduler's asks the pool what it can load and
plans each step (:mod:`.scheduler`); the worker's copies blocks and saves them (:mod:`.worker`). Both check at
start-up that the engine's KV fits the pool's arena and refuse with one line naming the flag to set.
"""

from __future__ import annotations

import secrets
import weakref
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvpool.errors import KvpoolError, LayoutMismatch, PoolUnavailable
from kvpool.integrations.vllm import generations, resident
from kvpool.integrations.vllm.identity import EngineIdentity
from kvpool.integrations.vllm.link import PoolLink, log
from kvpool.integrations.vllm.modes import (
    CopySchedulerMode,
    CopyWorkerMode,
    KvpoolMetadata,
    ResidentSchedulerMode,
    ResidentWorkerMode,
    SchedulerMode,
    WorkerMode,
)
from kvpool.integrations.vllm.plan import StepPlan
from kvpool.integrations.vllm.resident import ResidentSchedulerSide, ResidentWorker
from kvpool.integrations.vllm.scheduler import SchedulerSide
from kvpool.integrations.vllm.settings import (
    ConnectorSettings,
    check_engine,
    layerwise_for,
    unsupported,
    why_not_resident,
)
from kvpool.integrations.vllm.worker import WorkerSide
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

CACHE_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}
#: the connectors of this process (an engine core holds both sides of each of its engines)
LIVE: weakref.WeakSet[KvpoolConnector] = weakref.WeakSet()


def counters(*_: Any) -> dict[str, int]:
    """What this process's connectors did, summed (``LLM.collective_rpc(counters)`` asks an engine's core): in
    resident mode blocks installed from the pool and committed to it, and ``copied_blocks`` 0; in copy mode the
    blocks copied between vLLM's cache and the arena."""
    total: dict[str, int] = {}
    for connector in list(LIVE):
        for key, value in connector.counters().items():
            total[key] = total.get(key, 0) + value
    return total


def engine_layout(config: VllmConfig) -> KVLayout:
    """The KV layout this engine's model needs in the arena."""
    model, cache, parallel = config.model_config, config.cache_config, config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise LayoutMismatch(
            "the kvpool connector holds one rank's KV per arena: start vLLM with --tensor-parallel-size 1 "
            "--pipeline-parallel-size 1"
        )
    if cache.cache_dtype == "auto":
        dtype = str(model.dtype).removeprefix("torch.")
    elif cache.cache_dtype in CACHE_DTYPES:
        dtype = CACHE_DTYPES[cache.cache_dtype]
    else:
        raise LayoutMismatch(f"the kvpool connector cannot hold --kv-cache-dtype {cache.cache_dtype}: leave it auto")
    return KVLayout(
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        block_size=cache.block_size,
        dtype=dtype,
    )


class KvpoolConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.settings = ConnectorSettings.parse(tc.kv_connector_extra_config)
        LIVE.add(self)
        self.layout = engine_layout(vllm_config)
        why = unsupported(vllm_config, kv_cache_config)
        if why is not None:
            raise LayoutMismatch(f"kvpool: {why}")
        #: what the engine's KV is a function of: every chain it looks up, commits and parks is salted with it
        self.identity = EngineIdentity.of_config(vllm_config)
        engine_id = str(tc.engine_id)
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        names = {s: f"{self.settings.name}-{engine_id[:8]}-{s}" for s in ("scheduler", "worker")}
        link = PoolLink(self.settings.url, names[side], self.settings.token)
        #: this side's mode (copy or resident), the one object vLLM's calls for its role go to
        self.scheduler_mode: SchedulerMode | None = None
        self.worker_mode: WorkerMode | None = None
        if self.settings.mode == "resident" and self._resident(vllm_config, role, kv_cache_config, link.name):
            return
        if tc.kv_load_failure_policy != "recompute":
            log.warning("kvpool: set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config, so that a "
                        "block that fails to load is computed again instead of failing its request")  # fmt: skip
        if role == KVConnectorRole.SCHEDULER:
            self._check_pool(link, vllm_config)
            side = SchedulerSide(link, self.settings, self.layout.block_size, engine_id, names["worker"])
            early = self.settings.early_lookup and generations.current().early_arrivals()
            self.scheduler_mode = CopySchedulerMode(side, self.identity, early)
        else:
            mode = vllm_config.compilation_config.cudagraph_mode
            layerwise = layerwise_for(self.settings.layerwise, mode is not None and mode.has_full_cudagraphs())
            self.worker_mode = CopyWorkerMode(WorkerSide(link, self.layout, self.settings.reserve_blocks, layerwise),
                                              self.layout)  # fmt: skip

    # the sides behind the modes, by name (tests and benchmarks reach them)
    @property
    def _sched(self) -> SchedulerSide | None:
        return self.scheduler_mode.side if isinstance(self.scheduler_mode, CopySchedulerMode) else None

    @property
    def _worker(self) -> WorkerSide | None:
        return self.worker_mode.side if isinstance(self.worker_mode, CopyWorkerMode) else None

    @property
    def _resident_sched(self) -> ResidentSchedulerSide | None:
        return self.scheduler_mode.side if isinstance(self.scheduler_mode, ResidentSchedulerMode) else None

    @property
    def _resident_worker(self) -> ResidentWorker | None:
        return self.worker_mode.side if isinstance(self.worker_mode, ResidentWorkerMode) else None

    def _resident(self, config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig, name: str) -> bool:
        """Start this side in resident mode; False, after one line saying why, where the engine cannot be
        resident (copy mode then starts). A pool that is not there, or a setting that differs, refuses to start."""
        import vllm

        from kvpool.client import PoolClient
        from kvpool.slab import SlabClient, SlabConfig

        scheduler = role == KVConnectorRole.SCHEDULER
        s = self.settings
        why = why_not_resident(config, vllm.__version__)
        if why is not None:
            log.warning("kvpool: this engine cannot be resident (%s); it runs in copy mode", why)
            return False
        key = secrets.token_urlsafe(24)  # the session's name is this engine's alone
        try:
            client = PoolClient(s.url, name=name, role="other", token=s.token, reply_spin_s=0.0, name_key=key)
        except KvpoolError as exc:
            raise PoolUnavailable(
                f"kvpool: resident mode keeps this engine's KV in the pool's arena, and the pool cannot be reached "
                f'({exc}): start the pool first, or use "mode": "copy"'
            ) from exc
        try:
            descriptor = client.descriptor()
            self._check_pool_layout(descriptor, config)
            uuid = resident.gpu_uuid()
            why = resident.why_not(descriptor, uuid, len(kv_cache_config.kv_cache_groups))
            if why is not None:
                log.warning("kvpool: this engine cannot be resident (%s); it runs in copy mode", why)
                client.close()
                return False
            part = resident.arena_on(descriptor, uuid)
            assert part is not None
            resident.check_geometry(part, self.layout, kv_cache_config.num_blocks)
            if scheduler:  # its session draws its blocks from a slab on its GPU's arena
                device = part.device.index if part.device is not None and len(descriptor.arenas) > 1 else None
                slab = SlabConfig(s.slab_blocks, max(1, s.slab_blocks // 4), 1 << 20, handoffs=False, device=device)
                client.close()
                client = SlabClient(s.url, name=name, role="other", token=s.token, slab=slab, reply_spin_s=0.0,
                                    name_key=key)  # fmt: skip
                side = ResidentSchedulerSide(client, part, self.layout.block_size, s.claim_timeout_s, self.identity,
                                             load=s.load, save=s.save, device=device,
                                             peer_prefix_blocks=s.peer_prefix_blocks)  # fmt: skip
                side.generation.early_arrivals()
                self.scheduler_mode = ResidentSchedulerMode(side)
            else:
                kv_layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
                    config.cache_config, "kv_cache_layout", None
                )  # vLLM 0.29+: the physical layout its engine core resolved
                self.worker_mode = ResidentWorkerMode(ResidentWorker(client, part, self.layout, kv_cache_config,
                                                                     kv_layout))  # fmt: skip
        except BaseException:
            client.close()
            raise
        log.info("kvpool: %s side resident in the arena on %s (%d blocks)", "scheduler" if scheduler else "worker",
                 part.device.name if part.device else "?", part.num_blocks)  # fmt: skip
        return True

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads are waited for in each attention layer's hook, which a full CUDA graph skips: asked
        for explicitly, they give up full graphs; by default they are used only where there are none."""
        return ConnectorSettings.parse(extra_config).layerwise is True

    def _check_pool(self, link: PoolLink, config: VllmConfig) -> None:
        """Refuse at start-up an engine that does not fit the pool; a pool not there is only warned about."""
        try:
            descriptor = link.open().descriptor()
        except Exception as exc:
            log.warning("kvpool: the pool is not reachable (%s: %s); serving without it until it answers",
                        type(exc).__name__, exc)  # fmt: skip
            link.close()
            return
        try:
            self._check_pool_layout(descriptor, config)
        except LayoutMismatch:
            link.close()  # the engine stops here: its session goes now, not when its lease runs out
            raise

    def _check_pool_layout(self, descriptor: ArenaDescriptor, config: VllmConfig) -> None:
        model = config.model_config
        names = [model.model, *(model.served_model_name if isinstance(model.served_model_name, list)
                                else [model.served_model_name or model.model])]  # fmt: skip
        check_engine(descriptor.layout, self.layout, descriptor.model, names)

    # -- scheduler side ---------------------------------------------------------------------------------

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM 0.30+ built its ``KVCacheManager``: in resident mode, it and its block pool become resident."""
        super().bind_kv_cache_manager(kv_cache_manager)  # type: ignore[misc]
        if self.scheduler_mode is not None:
            self.scheduler_mode.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_mode is not None
        return self.scheduler_mode.get_num_new_matched_tokens(request, num_computed_tokens)

    def on_arrival(self, request: Request) -> None:
        """A request just decoded on the engine core's input thread (see ``arrivals``): its lookup starts now. Not
        for a pooling request: vLLM may refuse it before its scheduler sees it, and the lookup's refs would stay."""
        if getattr(request, "pooling_params", None) is not None or self.scheduler_mode is None:
            return
        self.scheduler_mode.on_arrival(request)

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler_mode is not None
        self.scheduler_mode.on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler_mode is not None
        self.scheduler_mode.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_mode is not None
        return self.scheduler_mode.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.scheduler_mode is not None
        return False, self.scheduler_mode.request_finished(request, block_ids)

    # -- worker side ------------------------------------------------------------------------------------

    def get_mem_pool_context(self) -> Any:
        """vLLM 0.31+: in resident mode, the KV cache is allocated in the arena."""
        return self.worker_mode.get_mem_pool_context() if self.worker_mode is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_mode is not None
        self.worker_mode.register_kv_caches(kv_caches)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpoolMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker_mode is not None:
            self.worker_mode.start_load_kv(self._plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker_mode is not None:
            self.worker_mode.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves run in wait_for_save, one batched copy per layer for the step

    def wait_for_save(self) -> None:
        if self.worker_mode is not None:
            self.worker_mode.wait_for_save(self._plan)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_mode.get_block_ids_with_load_errors() if self.worker_mode is not None else set()

    def flush(self) -> None:
        """Wait until this engine's saves reached the pool (tests and benchmarks; serving never needs to)."""
        for mode in (self.worker_mode, self.scheduler_mode):
            if mode is not None:
                mode.flush()

    def counters(self) -> dict[str, int]:
        """What this side did, for logs and benchmarks: in resident mode, blocks installed and committed, and
        ``copied_blocks`` 0; in copy mode, the worker's copies."""
        total: dict[str, int] = {}
        for mode in (self.scheduler_mode, self.worker_mode):
            if mode is not None:
                total.update(mode.counters())
        return total

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after a weight update: the engine moves to a new
        epoch, and from now on shares nothing computed before (the pool's entries stay, for engines still on
        them)."""
        if self.scheduler_mode is not None:
            self.scheduler_mode.reset()
        else:
            self.identity.renew()
        return True

    def shutdown(self) -> None:
        for mode in (self.scheduler_mode, self.worker_mode):
            if mode is not None:
                mode.close()
