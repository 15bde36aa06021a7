"""vLLM 0.29 and 0.30: resident mode replaces no vLLM attribute; the engine runs kvpool's scheduler class.

0.29 made one ``allocate_kv_cache`` (``v1/worker/utils.py``) of both runners' private allocation functions, and
its worker enters a memory context around it (``kv_cache_allocation_context``) that only a worker class can
provide. The scheduler side takes ``--scheduler-cls kvpool.integrations.vllm.ResidentAsyncScheduler`` (or
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
        overrides={},
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
REPLACES: tuple[str, ...] = ()
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


def start_worker(kv: Any, layer_index: Any) -> list[str]:
    # TODO(h48m): the arena handed to allocate_kv_cache through the worker's kv_cache_allocation_context
    # (kvpool.integrations.vllm.memory.arena_context); until then this generation's worker side is not resident
    raise NotImplementedError("kvpool: resident mode's worker side on vLLM 0.29-0.30 is not built yet")


def mem_pool_context(kv: Any, attaching: bool) -> AbstractContextManager[Any] | None:
    return None  # no such connector hook before vLLM 0.31
