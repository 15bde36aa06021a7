"""vLLM 0.31 to 0.33: resident mode replaces no vLLM attribute, and needs no flag beyond the connector's.

The scheduler side through the connector's ``bind_kv_cache_manager`` (0.30+), called once vLLM built its
``KVCacheManager``: the manager and its one ``BlockPool`` become resident by their classes (:func:`.blockpool.adopt`).
The worker side through the connector's ``get_mem_pool_context`` (0.31+), which the worker enters around its one
``allocate_kv_cache``: the arena as the memory pool (:mod:`.memory`). Lookups start when the scheduler takes a
request in (``on_new_request``).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from kvpool.integrations.vllm.generations import SCHEDULER, Surface, merged

SURFACE = merged(
    SCHEDULER,
    Surface(
        overrides={
            "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.bind_kv_cache_manager": (
                "kv_cache_manager",
            ),
            "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.get_mem_pool_context": (),
            "vllm.v1.core.block_pool:BlockPool.unpin_blocks": ("blocks", "on_reuse"),  # refused (sparse attention)
        },
        calls={},
        attributes=("vllm.v1.worker.utils:allocate_kv_cache",),  # the worker side's one allocation (memory.py)
        instance={},
    ),
)
REPLACES: tuple[str, ...] = ()
HOOK = "bind_kv_cache_manager"


def why_not(config: Any) -> str | None:
    return None


def start_scheduler(pool_class: Any) -> None:
    return None  # the connector adopts vLLM's block pool in bind_kv_cache_manager


def stop_scheduler() -> None:
    return None


def early_arrivals() -> bool:
    return False


def start_worker(kv: Any, layer_index: Any, kv_cache_config: Any = None, layout: str | None = None) -> list[str]:
    """Refuse a KV plan whose views would not be the arena (where vLLM resolved its ``layout``); no model runner is
    patched: the allocation goes through :func:`mem_pool_context`."""
    from kvpool.integrations.vllm import memory

    if kv_cache_config is not None and layout is not None:
        memory.check_plan(kv, kv_cache_config, layer_index, layout)
    return []


def mem_pool_context(kv: Any, attaching: bool) -> AbstractContextManager[Any] | None:
    """The arena as the memory vLLM allocates its KV cache from, zeroing it only where no engine serves from it."""
    from kvpool.integrations.vllm import memory

    return memory.arena_context(kv, attaching)
