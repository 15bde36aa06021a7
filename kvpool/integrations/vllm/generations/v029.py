"""vLLM 0.29 and 0.30: the scheduler side replaces no vLLM attribute (the engine runs kvpool's scheduler class); the
worker side wraps one method.

0.29 made one ``allocate_kv_cache`` (``v1/worker/utils.py``) of both runners' private allocation functions, and
its worker enters a memory context around it (``kv_cache_allocation_context``) that only a worker class can
provide: the worker side wraps ``Worker._maybe_get_memory_pool_context`` to ask the connector for it, as 0.31's
worker does (:func:`.memory.install_backport`), and that context makes the allocation the arena (:mod:`.memory`).
The scheduler side takes ``--scheduler-cls kvpool.integrations.vllm.ResidentAsyncScheduler`` (or
``ResidentScheduler``), which makes vLLM's one ``BlockPool`` and its ``KVCacheManager`` resident by their classes
once built (:func:`.blockpool.adopt`, as Dynamo's GPU Memory Service does). Lookups start when the scheduler takes a
request in (``on_new_request``): no hook reaches the engine core's input thread without a patch.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from kvpool.integrations.vllm.generations import SCHEDULER, Surface, merged

SURFACE = merged(
    SCHEDULER,
    Surface(
        overrides={"vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context": ("tag",)},  # the backport
        calls={},
        attributes=(  # kvpool's scheduler classes subclass both, and read kv_cache_manager and connector
            "vllm.v1.core.sched.scheduler:Scheduler",
            "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
            "vllm.config.scheduler:SchedulerConfig.get_scheduler_cls",
            "vllm.v1.worker.utils:allocate_kv_cache",  # the worker side's one allocation (memory.py)
        ),
        instance={},
    ),
)
#: the vLLM attributes this generation replaces at run time: on the worker, the one method that picks the KV
#: allocation's memory context, wrapped for its ``"kv_cache"`` tag only (0.31's worker asks the connector itself)
REPLACES = ("vllm.v1.worker.gpu_worker:Worker._maybe_get_memory_pool_context",)
HOOK = "scheduler_cls"
SCHEDULER_CLS = "kvpool.integrations.vllm.ResidentAsyncScheduler"


def why_not(config: Any) -> str | None:
    """This generation is resident only under kvpool's scheduler class."""
    from kvpool.integrations.vllm.schedulers import ResidentScheduler

    try:
        cls = config.scheduler_config.get_scheduler_cls()
    except Exception as exc:
        return f"its --scheduler-cls does not load ({exc})"
    if isinstance(cls, type) and issubclass(cls, ResidentScheduler):
        return None
    return (
        f"on this vLLM resident mode runs under kvpool's scheduler class: start vLLM with --scheduler-cls "
        f"{SCHEDULER_CLS} (kvpool.integrations.vllm.ResidentScheduler with --no-async-scheduling)"
    )


def start_scheduler(pool_class: Any) -> None:
    return None  # the scheduler class adopts vLLM's block pool once built


def stop_scheduler() -> None:
    return None


def early_arrivals() -> bool:
    return False


def start_worker(kv: Any, layer_index: Any, kv_cache_config: Any = None, layout: str | None = None) -> list[str]:
    """Refuse a KV plan whose views would not be the arena (where vLLM resolved its ``layout``), then have the worker
    ask the connector for its KV allocation's context as 0.31's does (:func:`.memory.install_backport`). No model
    runner is patched: vLLM's one ``allocate_kv_cache`` runs inside :func:`mem_pool_context`."""
    from kvpool.integrations.vllm import memory

    if kv_cache_config is not None and layout is not None:
        memory.check_plan(kv, kv_cache_config, layer_index, layout)
    memory.install_backport()
    return []


def mem_pool_context(kv: Any, attaching: bool) -> AbstractContextManager[Any] | None:
    """The arena as the memory vLLM allocates its KV cache from (asked through the backport)."""
    from kvpool.integrations.vllm import memory

    return memory.arena_context(kv, attaching)
