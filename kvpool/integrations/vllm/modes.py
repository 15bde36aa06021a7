"""The connector's two modes, each an object per role behind one interface (as vLLM's ``nixl/`` connector splits
its scheduler and worker): :class:`KvpoolConnector <.connector.KvpoolConnector>` picks one at start-up and passes
vLLM's calls to it, so no method of the connector asks which mode it is in.

* **Copy mode** (:class:`CopySchedulerMode`, :class:`CopyWorkerMode`): vLLM keeps its own KV cache; the scheduler
  side plans each step's loads and saves (:mod:`.scheduler`), the worker side copies blocks between vLLM's cache and
  the arena (:mod:`.worker`).
* **Resident mode** (:class:`ResidentSchedulerMode`, :class:`ResidentWorkerMode`): the engine's KV cache is the
  arena; the scheduler side keeps its blocks under vLLM's block pool, the worker side copies nothing
  (:mod:`.resident`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpool.errors import LayoutMismatch
from kvpool.integrations.vllm.link import log
from kvpool.integrations.vllm.plan import StepPlan
from kvpool.integrations.vllm.scheduler import Scheduled

if TYPE_CHECKING:
    import torch

    from kvpool.integrations.vllm.identity import EngineIdentity
    from kvpool.integrations.vllm.resident import ResidentSchedulerSide, ResidentWorker
    from kvpool.integrations.vllm.scheduler import SchedulerSide
    from kvpool.integrations.vllm.worker import WorkerSide
    from kvpool.layout import KVLayout


@dataclass
class KvpoolMetadata(KVConnectorMetadata):
    plan: StepPlan = field(default_factory=StepPlan)


class SchedulerMode(Protocol):
    """What the connector's scheduler side does in a mode: vLLM's scheduler-side calls, less the connector's own."""

    def bind_kv_cache_manager(self, manager: Any) -> None: ...

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]: ...

    def on_arrival(self, request: Any) -> None: ...

    def on_new_request(self, request: Any) -> None: ...

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None: ...

    def build_connector_meta(self, scheduler_output: Any) -> KvpoolMetadata: ...

    def request_finished(self, request: Any, block_ids: list[int]) -> dict[str, Any] | None: ...

    def reset(self) -> None: ...

    def flush(self) -> None: ...

    def counters(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class WorkerMode(Protocol):
    """What the connector's worker side does in a mode; ``plan`` gives the step's plan (copy mode's alone asks)."""

    def get_mem_pool_context(self) -> Any: ...

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None: ...

    def start_load_kv(self, plan: Callable[[], StepPlan]) -> None: ...

    def wait_for_layer_load(self, layer_name: str) -> None: ...

    def wait_for_save(self, plan: Callable[[], StepPlan]) -> None: ...

    def get_block_ids_with_load_errors(self) -> set[int]: ...

    def flush(self) -> None: ...

    def counters(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class CopySchedulerMode:
    """Copy mode's scheduler side: lookups and claims for vLLM's requests, and each step's loads and saves."""

    def __init__(self, side: SchedulerSide, identity: EngineIdentity, early: bool) -> None:
        self.side = side
        self.identity = identity
        self.early = early  # lookups start on the engine core's input thread

    def _salt(self, request: Any) -> str | None:
        """The request's KV identity where copy mode shares it: requests of the engine's own identity only (the
        worker's copies name no adapter), so LoRA and salted requests are kept out as well."""
        salt = self.identity.of(request)
        return salt if salt == self.identity.salt else None

    def bind_kv_cache_manager(self, manager: Any) -> None:
        return None

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        salt = self._salt(request)
        if salt is None:
            self.side.skip(request.request_id)
            return 0, False
        prompt = tokens_of(request.prompt_token_ids)
        return self.side.match(request.request_id, prompt, num_computed_tokens, request.kv_transfer_params,
                               salt), False  # fmt: skip

    def on_arrival(self, request: Any) -> None:
        if self.early:
            self._prefetch(request)

    def on_new_request(self, request: Any) -> None:
        self._prefetch(request)

    def _prefetch(self, request: Any) -> None:
        salt = self._salt(request)
        if salt is not None:
            self.side.prefetch(request.request_id, tokens_of(request.prompt_token_ids), request.kv_transfer_params,
                               salt)  # fmt: skip

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.side.after_alloc(request.request_id, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvpoolMetadata:
        out = scheduler_output
        scheduled = [
            Scheduled(
                r.req_id,
                r.num_computed_tokens,
                out.num_scheduled_tokens.get(r.req_id, 0),
                list(r.block_ids[0]),
                True,
                tokens_of(r.prompt_token_ids),
            )
            for r in out.scheduled_new_reqs
        ]
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            scheduled.append(Scheduled(req_id, cached.num_computed_tokens[i], out.num_scheduled_tokens.get(req_id, 0),
                                       list(new[0]) if new else [], req_id in cached.resumed_req_ids))  # fmt: skip
        return KvpoolMetadata(self.side.build(scheduled))

    def request_finished(self, request: Any, block_ids: list[int]) -> dict[str, Any] | None:
        return self.side.finished(request.request_id)

    def reset(self) -> None:
        self.identity.renew()
        log.info("kvpool: the engine's cache was reset: it shares nothing computed before (epoch %d)",
                 self.identity.epoch)  # fmt: skip

    def flush(self) -> None:
        return None

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self.side.close()


class CopyWorkerMode:
    """Copy mode's worker side: each step's blocks copied from the arena before the forward, and into it after."""

    def __init__(self, side: WorkerSide, layout: KVLayout) -> None:
        self.side = side
        self.layout = layout

    def get_mem_pool_context(self) -> Any:
        return None  # vLLM allocates its own KV cache

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        if len(kv_caches) != self.layout.num_layers:
            raise LayoutMismatch(
                f"vLLM has {len(kv_caches)} KV caches for {self.layout.num_layers} layers: the kvpool connector "
                "needs one per attention layer (no shared or cross-layer KV)"
            )
        self.side.register(kv_caches, extract_layer_index)

    def start_load_kv(self, plan: Callable[[], StepPlan]) -> None:
        self.side.load(plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.side.wait_layer(layer_name)

    def wait_for_save(self, plan: Callable[[], StepPlan]) -> None:
        self.side.save(plan())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.side.take_failed()

    def flush(self) -> None:
        self.side.flush()

    def counters(self) -> dict[str, int]:
        return self.side.counters()

    def close(self) -> None:
        self.side.close()


class ResidentSchedulerMode:
    """Resident mode's scheduler side: nothing to load (the pool's blocks are the engine's KV cache), hits installed
    under vLLM's block pool, finished requests committed or parked by id."""

    def __init__(self, side: ResidentSchedulerSide) -> None:
        self.side = side

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self.side.adopt(manager)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return (None, False) if self.side.deferred(request) else (0, False)

    def on_arrival(self, request: Any) -> None:
        self.side.arrive(request)

    def on_new_request(self, request: Any) -> None:
        self.side.arrive(request)  # a second call for one request starts nothing

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.side.after_alloc(request)

    def build_connector_meta(self, scheduler_output: Any) -> KvpoolMetadata:
        self.side.step()
        return KvpoolMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> dict[str, Any] | None:
        return self.side.finished(request, block_ids)

    def reset(self) -> None:
        self.side.reset()

    def flush(self) -> None:
        self.side.residency.drain()

    def counters(self) -> dict[str, int]:
        residency = self.side.residency
        return {**vars(residency.counters), **residency.handovers.summary()}

    def close(self) -> None:
        self.side.close()


class ResidentWorkerMode:
    """Resident mode's worker side: vLLM's KV cache allocated in the arena, nothing loaded or saved, the engine's
    lease proven before each launch."""

    def __init__(self, side: ResidentWorker) -> None:
        self.side = side

    def get_mem_pool_context(self) -> Any:
        return self.side.mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.side.register(kv_caches)

    def start_load_kv(self, plan: Callable[[], StepPlan]) -> None:
        self.side.check()  # nothing to load, the KV is where vLLM reads it; the lease is checked

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def wait_for_save(self, plan: Callable[[], StepPlan]) -> None:
        return None  # vLLM wrote its KV into the arena already

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def flush(self) -> None:
        return None

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        self.side.close()


def tokens_of(prompt: list[int] | None) -> list[int]:
    """vLLM's own list of a prompt's token ids, not a copy: it never changes them, and neither does the connector.
    Each copy of a 1,024-token prompt touches 1,024 int objects; in a burst's step, three copies a request were a
    third of the scheduler side's time (vLLM's ``schedule()`` timed on the CPU: see the docs' benchmarks)."""
    return prompt if type(prompt) is list else list(prompt or [])
