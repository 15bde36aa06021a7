"""``KvpoolConnector``: vLLM's KV connector API (v1) on kvpool's scheduler and worker sides.

vLLM builds one instance per role in the engine's processes: the scheduler's asks the pool what it can load and
plans each step (:mod:`.scheduler`); the worker's copies blocks and saves them (:mod:`.worker`). Both check at
start-up that the engine's KV fits the pool's arena and refuse with one line naming the flag to set.
"""

from __future__ import annotations

import secrets
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.model_executor.models.utils import extract_layer_index

from kvpool.errors import KvpoolError, LayoutMismatch, PoolUnavailable
from kvpool.integrations.vllm import generations, resident
from kvpool.integrations.vllm.identity import EngineIdentity
from kvpool.integrations.vllm.link import PoolLink, log
from kvpool.integrations.vllm.plan import StepPlan
from kvpool.integrations.vllm.resident import ResidentSchedulerSide, ResidentWorker
from kvpool.integrations.vllm.scheduler import Scheduled, SchedulerSide
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


@dataclass
class KvpoolMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


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
        self._sched: SchedulerSide | None = None
        self._early = False
        self._worker: WorkerSide | None = None
        self._resident_sched: ResidentSchedulerSide | None = None
        self._resident_worker: ResidentWorker | None = None
        if self.settings.mode == "resident" and self._resident(vllm_config, role, kv_cache_config, link.name):
            return
        if tc.kv_load_failure_policy != "recompute":
            log.warning("kvpool: set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config, so that a "
                        "block that fails to load is computed again instead of failing its request")  # fmt: skip
        if role == KVConnectorRole.SCHEDULER:
            self._check_pool(link, vllm_config)
            self._sched = SchedulerSide(link, self.settings, self.layout.block_size, engine_id, names["worker"])
            self._early = self.settings.early_lookup and generations.current().early_arrivals()
        else:
            mode = vllm_config.compilation_config.cudagraph_mode
            layerwise = layerwise_for(self.settings.layerwise, mode is not None and mode.has_full_cudagraphs())
            self._worker = WorkerSide(link, self.layout, self.settings.reserve_blocks, layerwise)

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
                self._resident_sched = ResidentSchedulerSide(client, part, self.layout.block_size, s.claim_timeout_s,
                                                         self.identity, load=s.load, save=s.save,
                                                         device=device)  # fmt: skip
                self._resident_sched.generation.early_arrivals()
            else:
                kv_layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
                    config.cache_config, "kv_cache_layout", None
                )  # vLLM 0.29+: the physical layout its engine core resolved
                self._resident_worker = ResidentWorker(client, part, self.layout, kv_cache_config, kv_layout)
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
        if self._resident_sched is not None:
            self._resident_sched.adopt(kv_cache_manager)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._resident_sched is not None:  # the pool's blocks are this engine's KV cache: nothing to load
            return (None, False) if self._resident_sched.deferred(request) else (0, False)
        assert self._sched is not None
        salt = self._copy_salt(request)
        if salt is None:
            self._sched.skip(request.request_id)
            return 0, False
        prompt = _tokens(request.prompt_token_ids)
        return self._sched.match(request.request_id, prompt, num_computed_tokens, request.kv_transfer_params,
                                 salt), False  # fmt: skip

    def _copy_salt(self, request: Request) -> str | None:
        """The request's KV identity where copy mode shares it: requests of the engine's own identity only (the
        worker's copies name no adapter), so LoRA and salted requests are kept out as well."""
        salt = self.identity.of(request)
        return salt if salt == self.identity.salt else None

    def on_arrival(self, request: Request) -> None:
        """A request just decoded on the engine core's input thread (see ``arrivals``): its lookup starts now. Not
        for a pooling request: vLLM may refuse it before its scheduler sees it, and the lookup's refs would stay."""
        if getattr(request, "pooling_params", None) is not None:
            return
        if self._resident_sched is not None:
            self._resident_sched.arrive(request)
        elif self._early:
            self._prefetch(request)

    def on_new_request(self, request: Request) -> None:
        if self._resident_sched is not None:
            self._resident_sched.arrive(request)  # a second call for one request starts nothing
            return
        self._prefetch(request)

    def _prefetch(self, request: Request) -> None:
        assert self._sched is not None
        salt = self._copy_salt(request)
        if salt is not None:
            self._sched.prefetch(request.request_id, _tokens(request.prompt_token_ids), request.kv_transfer_params,
                                 salt)  # fmt: skip

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._resident_sched is not None:
            self._resident_sched.after_alloc(request)
            return
        assert self._sched is not None
        self._sched.after_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self._resident_sched is not None:
            self._resident_sched.step()
            return KvpoolMetadata()
        assert self._sched is not None
        out = scheduler_output
        scheduled = [
            Scheduled(
                r.req_id,
                r.num_computed_tokens,
                out.num_scheduled_tokens.get(r.req_id, 0),
                list(r.block_ids[0]),
                True,
                _tokens(r.prompt_token_ids),
            )
            for r in out.scheduled_new_reqs
        ]
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            scheduled.append(Scheduled(req_id, cached.num_computed_tokens[i], out.num_scheduled_tokens.get(req_id, 0),
                                       list(new[0]) if new else [], req_id in cached.resumed_req_ids))  # fmt: skip
        return KvpoolMetadata(self._sched.build(scheduled))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._resident_sched is not None:
            return False, self._resident_sched.finished(request, block_ids)
        assert self._sched is not None
        return False, self._sched.finished(request.request_id)

    # -- worker side ------------------------------------------------------------------------------------

    def get_mem_pool_context(self) -> Any:
        """vLLM 0.31+: in resident mode, the KV cache is allocated in the arena."""
        return self._resident_worker.mem_pool_context() if self._resident_worker is not None else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._resident_worker is not None:
            self._resident_worker.register(kv_caches)
            return
        assert self._worker is not None
        if len(kv_caches) != self.layout.num_layers:
            raise LayoutMismatch(
                f"vLLM has {len(kv_caches)} KV caches for {self.layout.num_layers} layers: the kvpool connector "
                "needs one per attention layer (no shared or cross-layer KV)"
            )
        self._worker.register(kv_caches, extract_layer_index)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpoolMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._resident_worker is not None:  # nothing to load, the KV is where vLLM reads it; the lease is checked
            self._resident_worker.check()
            return
        if self._worker is None:
            return
        assert self._worker is not None
        self._worker.load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is None:
            return
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves run in wait_for_save, one batched copy per layer for the step

    def wait_for_save(self) -> None:
        if self._worker is None:
            return  # resident: vLLM wrote its KV into the arena already
        self._worker.save(self._plan())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_failed() if self._worker is not None else set()

    def flush(self) -> None:
        """Wait until this engine's saves reached the pool (tests and benchmarks; serving never needs to)."""
        if self._worker is not None:
            self._worker.flush()
        if self._resident_sched is not None:
            self._resident_sched.residency.drain()

    def counters(self) -> dict[str, int]:
        """What this side did, for logs and benchmarks: in resident mode, blocks installed and committed, and
        ``copied_blocks`` 0; in copy mode, the worker's copies."""
        if self._resident_sched is not None:
            residency = self._resident_sched.residency
            return {**vars(residency.counters), **residency.handovers.summary()}
        if self._worker is not None:
            return self._worker.counters()
        return {}

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``, as after a weight update: the engine moves to a new
        epoch, and from now on shares nothing computed before (the pool's entries stay, for engines still on
        them)."""
        if self._resident_sched is not None:
            self._resident_sched.reset()
        else:
            self.identity.renew()
            log.info("kvpool: the engine's cache was reset: it shares nothing computed before (epoch %d)",
                     self.identity.epoch)  # fmt: skip
        return True

    def shutdown(self) -> None:
        for side in (self._sched, self._worker, self._resident_sched, self._resident_worker):
            if side is not None:
                side.close()


def _tokens(prompt: list[int] | None) -> list[int]:
    """vLLM's own list of a prompt's token ids, not a copy: it never changes them, and neither does the connector.
    Each copy of a 1,024-token prompt touches 1,024 int objects; in a burst's step, three copies a request were a
    third of the scheduler side's time (vLLM's ``schedule()`` timed on the CPU: see the docs' benchmarks)."""
    return prompt if type(prompt) is list else list(prompt or [])
