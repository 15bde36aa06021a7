"""vLLM 0.26 to 0.28: resident mode replaces vLLM attributes at run time, the only way these releases allow.

Their connector never sees the ``KVCacheManager`` (only its block pool, once built), and their model runners
allocate the KV cache in private functions with no hook. So the scheduler side replaces the ``BlockPool`` that
``kv_cache_coordinator`` builds and wraps two ``KVCacheManager`` methods (:func:`.blockpool.install`), lookups start
on the engine core's input thread through a wrapped ``EngineCore.preprocess_add_request`` (:mod:`.arrivals`), and
the worker side points both runners' allocation at the arena (:mod:`.kvmemory`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from kvpool.integrations.vllm.generations import SCHEDULER, Surface, merged

SURFACE = merged(
    SCHEDULER,
    Surface(
        overrides={
            # wrapped as (manager, request): a parameter vLLM adds would be dropped
            "vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks": ("request",),
            "vllm.v1.engine.core:EngineCore.preprocess_add_request": ("request",),
            "vllm.v1.worker.gpu_model_runner:GPUModelRunner._allocate_kv_cache_tensors": ("kv_cache_config",),
            "vllm.v1.worker.gpu.attn_utils:_allocate_kv_cache": ("kv_cache_config", "shared_layers", "device"),
        },
        calls={},
        attributes=("vllm.v1.core.kv_cache_coordinator:BlockPool",),
        instance={},
    ),
)
#: the vLLM attributes this generation replaces at run time (resident mode; copy mode the arrival hook only)
REPLACES = (
    "vllm.v1.core.kv_cache_coordinator:BlockPool",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots",
    "vllm.v1.engine.core:EngineCore.preprocess_add_request",
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._allocate_kv_cache_tensors",
    "vllm.v1.worker.gpu.attn_utils:_allocate_kv_cache",
)
#: how the engine's block pool becomes resident
HOOK = "patch"


def why_not(config: Any) -> str | None:
    """What of this engine's settings this generation cannot be resident with (None: nothing)."""
    return None


def start_scheduler(pool_class: Any) -> None:
    """Before vLLM builds the ``KVCacheManager``: the next one's block pool is ``pool_class``."""
    from kvpool.integrations.vllm import blockpool

    blockpool.install(pool_class)


def stop_scheduler() -> None:
    from kvpool.integrations.vllm import blockpool

    blockpool.uninstall()


def early_arrivals() -> bool:
    """Start lookups on the engine core's input thread; False where this vLLM has no place for it."""
    from kvpool.integrations.vllm import arrivals

    return arrivals.install()


def start_worker(kv: Any, layer_index: Any, kv_cache_config: Any = None, layout: str | None = None) -> list[str]:
    """Point vLLM's KV cache allocation at the arena; returns the model runners that now take it from there (each
    layer's allocation is checked as it is made: no plan to check ahead)."""
    from kvpool.integrations.vllm import kvmemory

    return kvmemory.install(kv, layer_index)


def mem_pool_context(kv: Any, attaching: bool) -> AbstractContextManager[Any] | None:
    return None  # no such connector hook before vLLM 0.31
