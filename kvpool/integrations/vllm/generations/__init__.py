"""Which vLLM generation this process runs, and the private vLLM surface each generation's module names.

kvpool reaches into vLLM's scheduler (its ``BlockPool``, ``KVCacheManager`` and ``Request``) and its KV cache
allocation, none of which vLLM keeps stable between releases. Every private symbol kvpool touches is named in the
module of the generation it belongs to (``v026``, ``v029``, ``v031``), so that one release's move is one module's
change, and the drift test (tests/integrations/test_vllm_drift.py) checks each name against the installed wheel.
The generation is chosen once, from ``vllm.__version__``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Surface:
    """The private vLLM a generation relies on, by kind of reliance.

    ``overrides``: methods kvpool's subclasses replace, whose parameters must be exactly these (vLLM calls them);
    ``calls``: callables kvpool calls with these leading parameters (more are fine if they have defaults);
    ``attributes``: names that must exist on a module or class; ``instance``: attributes a built object must have,
    by its class's ``module:name``.
    """

    overrides: dict[str, tuple[str, ...]]
    calls: dict[str, tuple[str, ...]]
    attributes: tuple[str, ...]
    instance: dict[str, tuple[str, ...]]

    def names(self) -> list[str]:
        return [*self.overrides, *self.calls, *self.attributes]


#: the scheduler side's surface, the same from vLLM 0.26 to 0.33 (a generation that differs names its own)
SCHEDULER = Surface(
    overrides={
        "vllm.v1.core.block_pool:BlockPool.get_new_blocks": ("num_blocks",),
        "vllm.v1.core.block_pool:BlockPool.touch": ("blocks",),
        "vllm.v1.core.block_pool:BlockPool.free_blocks": ("ordered_blocks",),
        "vllm.v1.core.block_pool:BlockPool.reset_prefix_cache": (),
        "vllm.v1.core.block_pool:BlockPool.get_num_free_blocks": (),
        "vllm.v1.core.block_pool:BlockPool.get_usage": (),
    },
    calls={
        "vllm.v1.core.block_pool:BlockPool.get_cached_block": ("block_hash", "kv_cache_group_ids"),
        "vllm.v1.core.block_pool:BlockPool._insert_block_hash": ("block_hash_with_group_id", "block", "num_tokens"),
        "vllm.v1.core.block_pool:BlockPool._remove_cached_block_hashes": ("block",),
        "vllm.v1.core.block_pool:BlockPool._emit_block_removed_events": ("block_hashes",),
        "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue": ("blocks",),
        "vllm.v1.core.kv_cache_utils:make_block_hash_with_group_id": ("block_hash", "group_id"),
        "vllm.v1.core.kv_cache_manager:KVCacheManager.get_computed_blocks": ("request",),
        "vllm.v1.core.kv_cache_manager:KVCacheManager.allocate_slots": ("request", "num_new_tokens"),
        "vllm.v1.core.kv_cache_manager:KVCacheManager.create_kv_cache_blocks": ("blocks",),
    },
    attributes=(
        "vllm.v1.core.kv_cache_utils:KVCacheBlock",
        "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1.bind_gpu_block_pool",
        "vllm.model_executor.models.utils:extract_layer_index",
    ),
    instance={
        "vllm.v1.core.block_pool:BlockPool": (
            "blocks",
            "free_block_queue",
            "metrics_collector",
            "hash_block_size",
            "num_gpu_blocks",
            "enable_caching",
        ),
        "vllm.v1.core.kv_cache_manager:KVCacheManager": (
            "block_pool",
            "enable_caching",
            "log_stats",
            "prefix_cache_stats",
            "enable_kv_cache_events",
            "empty_kv_cache_blocks",
        ),
        "vllm.v1.core.kv_cache_utils:KVCacheBlock": ("block_id", "ref_cnt", "block_hash", "is_null"),
        "vllm.v1.request:Request": (
            "request_id",
            "block_hashes",
            "num_tokens",
            "num_preemptions",
            "kv_transfer_params",
            "prompt_token_ids",
            "num_computed_tokens",
            "all_token_ids",
            "lora_request",
            "mm_features",
        ),
    },
)


def merged(*surfaces: Surface) -> Surface:
    """One surface of several (a generation's own on top of the scheduler side's)."""
    instance: dict[str, tuple[str, ...]] = {}
    for s in surfaces:
        for name, attrs in s.instance.items():
            instance[name] = (*instance.get(name, ()), *attrs)
    return Surface(
        overrides={k: v for s in surfaces for k, v in s.overrides.items()},
        calls={k: v for s in surfaces for k, v in s.calls.items()},
        attributes=tuple(a for s in surfaces for a in s.attributes),
        instance=instance,
    )


def resolve(name: str) -> Any:
    """The object ``module:attr.attr`` names; AttributeError or ImportError where it is gone."""
    module, _, path = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def parameters(obj: Any) -> list[inspect.Parameter]:
    """A callable's parameters, less ``self``."""
    params = list(inspect.signature(obj).parameters.values())
    return params[1:] if params and params[0].name == "self" else params


def drift(surface: Surface) -> list[str]:
    """What of ``surface`` the installed vLLM no longer has as named (empty: nothing moved)."""
    out = []
    for name, want in surface.overrides.items():
        try:
            got = tuple(p.name for p in parameters(resolve(name)))
        except (ImportError, AttributeError) as exc:
            out.append(f"{name}: gone ({exc})")
            continue
        if got != want:
            out.append(f"{name}: parameters {got}, kvpool overrides it as {want}")
    for name, want in surface.calls.items():
        try:
            params = parameters(resolve(name))
        except (ImportError, AttributeError) as exc:
            out.append(f"{name}: gone ({exc})")
            continue
        got = tuple(p.name for p in params[: len(want)])
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        rest = [p.name for p in params[len(want) :] if p.default is p.empty and p.kind not in variadic]
        if got != want or rest:
            out.append(f"{name}: parameters {tuple(p.name for p in params)}, kvpool calls it with {want}")
    for name in surface.attributes:
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            out.append(f"{name}: gone ({exc})")
    return out


def generation_of(version: str) -> str:
    """The generation module that holds ``version``'s surface (the newest one for a release after it)."""
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < (0, 29):
        return "v026"
    if (major, minor) < (0, 31):
        return "v029"
    return "v031"


@cache
def of_version(version: str) -> ModuleType:
    """The generation module of vLLM ``version``."""
    return importlib.import_module(f"{__name__}.{generation_of(version)}")


def current() -> ModuleType:
    """The installed vLLM's generation module."""
    import vllm

    return of_version(vllm.__version__)
