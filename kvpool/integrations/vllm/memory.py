"""Where a resident engine's KV cache lives on vLLM 0.29 and later: the one backing allocation is the arena.

From 0.29 vLLM allocates every layer's KV in ONE ``torch.zeros(size, int8)`` (``vllm/v1/worker/utils.py``
``allocate_kv_cache``) and cuts per-layer views from it by each ``KVCacheTensor(size, layers, layer_stride,
block_stride, offset)``: layer ``layers[l]``'s page of block ``b`` starts at ``offset + l * layer_stride + b *
block_stride``, and inside a page the layout's order of ``[H, N, C]`` holds (``v1/kv_cache_layout.py``; C is one
head's K then V, ``(head_size + head_size_v) * itemsize`` bytes).

The rule, read from vLLM's planner (``get_kv_cache_config_from_groups``) and checked on the CPU against its own
views (tests/integrations/test_vllm_memory.py): vLLM's views of the backing ARE the ``kv_packed`` arena's layer
regions, byte for byte, with no new arena order, when

* the layout is ``LBNHC`` (vLLM's default; layer-outer, NHD: a page is ``[block_size, heads, 2 * head_dim]``, what
  ``kv_packed`` lays out);
* the model has one KV cache group of one layer shape, so there is one ``KVCacheTensor``, at ``offset`` 0, with
  ``layer_stride == num_blocks * page`` and ``block_stride == page`` (no padded pages), ``size == num_blocks *
  block_nbytes`` (the arena's whole KV span);
* its ``layers`` run in the arena's layer order (layer ``i`` is the model's attention layer ``i``), and the engine's
  block count, block size, dtype, heads and head dim are the pool's (``--num-gpu-blocks-override``).

:func:`check_plan` refuses anything else, naming the setting. A kernel block size smaller than the block size (the
backend splits a block into kernel blocks) views the same bytes, and :func:`check_bound` accepts it.

How vLLM gets the arena, with no vLLM attribute replaced on 0.31 and later: the connector's
``get_mem_pool_context()`` returns :func:`arena_context`, which the worker enters around exactly that allocation. It
routes the allocation to a ``torch.cuda.MemPool`` whose allocator hands out the arena's base for the one request
that fits the arena, and frees nothing (:mod:`.arenapool`). While an engine attaches to a live arena (another engine
serves from it), the context also turns that one ``torch.zeros`` into ``torch.empty``, so joining never wipes the
first engine's KV.
On 0.29 and 0.30 the worker has no such hook: :func:`install_backport` makes the worker ask the connector for the
same context, as 0.31's worker does (one method, ``Worker._maybe_get_memory_pool_context``, wrapped for its
``"kv_cache"`` tag only). vLLM 0.26-0.28 keep :mod:`.kvmemory`.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from types import TracebackType
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

from kvpool.errors import LayoutMismatch
from kvpool.integrations.vllm.arenapool import ArenaPool, Handout
from kvpool.layout import KVLayout

log = logging.getLogger("vllm.kvpool")

#: vLLM's name of the one physical KV layout that is the kv_packed arena (``KVCacheLayout.LBNHC``)
LAYOUT = "LBNHC"
_WRAPPED = "_kvpool_memory"


class ArenaLike(Protocol):
    """What this module needs of the arena (``kvmemory.ArenaKV`` is one): its mapped bytes as one int8 tensor on
    the engine's GPU, the layout and the block count."""

    raw: torch.Tensor
    layout: KVLayout
    num_blocks: int
    handed: dict[str, int]

    def check(self, kv_caches: dict[str, torch.Tensor]) -> None: ...


def kv_bytes(arena: ArenaLike) -> int:
    """The arena's KV span: what vLLM's one backing allocation must be."""
    return arena.num_blocks * arena.layout.block_nbytes


def check_plan(
    arena: ArenaLike, kv_cache_config: Any, layer_index: Callable[[str], int], layout: str | None = None
) -> None:
    """Refuse, naming the setting, a vLLM KV plan (its ``KVCacheConfig``, and the physical layout's name, by default
    the one the engine core resolved into it) whose views of the one backing would not be the arena's layer regions.
    The connector's worker side calls it when it is built (it gets the ``KVCacheConfig``), before vLLM allocates."""
    lay = arena.layout
    layout = layout or getattr(kv_cache_config, "kv_cache_layout", None) or "an unresolved layout"
    if layout != LAYOUT:
        raise LayoutMismatch(
            f"vLLM lays this engine's KV cache out as {layout}; the arena is kv_packed, vLLM's {LAYOUT}: unset "
            f"VLLM_KV_CACHE_LAYOUT (or set it to {LAYOUT}) and use an attention backend with the NHD layout "
            "(TRITON_ATTN, FLASH_ATTN), or the connector's copy mode"
        )
    if kv_cache_config.num_blocks != arena.num_blocks:
        raise LayoutMismatch(
            f"this engine has {kv_cache_config.num_blocks} KV blocks, the pool's arena {arena.num_blocks}: start "
            f"vLLM with --num-gpu-blocks-override {arena.num_blocks}"
        )
    tensors = kv_cache_config.kv_cache_tensors
    if len(tensors) != 1 or getattr(tensors[0], "host_resident", False):
        raise LayoutMismatch(
            f"this model's KV cache has {len(tensors)} placements (layers of several shapes, hybrid or "
            "host-resident groups); resident mode holds one on the GPU: use the connector's copy mode"
        )
    (tensor,) = tensors
    page = lay.block_nbytes // lay.num_layers
    want = {"size": kv_bytes(arena), "offset": 0, "layer_stride": arena.num_blocks * page, "block_stride": page}
    got = {name: getattr(tensor, name) for name in want}
    if got != want or len(tensor.layers) != lay.num_layers:
        raise LayoutMismatch(
            f"vLLM places this engine's KV as {len(tensor.layers)} layers of {got}, the arena as {lay.num_layers} "
            f"layers of {want} ({arena.num_blocks} blocks of {page} bytes a layer): start the pool with this "
            "engine's --num-layers, --num-kv-heads, --head-dim, --block-size and --dtype"
        )
    order = [layer_index(name) for name in tensor.layers]
    if order != list(range(lay.num_layers)):
        raise LayoutMismatch(
            f"vLLM places this model's attention layers in the order {order}, the arena by layer index: this "
            "model's layer names do not give its layers' order, use the connector's copy mode"
        )


def check_bound(arena: ArenaLike, kv_caches: dict[str, torch.Tensor], layer_index: Callable[[str], int]) -> None:
    """What vLLM registers (``register_kv_caches``) must be the arena's layer regions as kv_packed lays them out;
    call it there. Records which arena layer each of vLLM's layers is, then runs the arena's own check."""
    for name in kv_caches:
        arena.handed[name] = layer_index(name)
    arena.check(kv_caches)


class ZerosAsEmpty(TorchFunctionMode):
    """Turns vLLM's ``torch.zeros(nbytes, dtype=torch.int8)`` of the KV backing into ``torch.empty``, and nothing
    else: an engine joining a live arena must not zero the KV other engines serve from."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.turned = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.zeros and kwargs.get("dtype") == torch.int8 and _numel(args) == self.nbytes:
            self.turned += 1
            return torch.empty(*args, **kwargs)
        return func(*args, **kwargs)


def _numel(args: tuple) -> int | None:
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    try:
        n = 1
        for dim in shape:
            n *= int(dim)
        return n
    except (TypeError, ValueError):
        return None


class ArenaContext(AbstractContextManager[None]):
    """The allocation context of :func:`arena_context`. On exit (when vLLM's allocation went through) it raises
    ``LayoutMismatch`` unless the arena became the KV backing."""

    def __init__(self, arena: ArenaLike, attaching: bool) -> None:
        self.arena = arena
        self.attaching = attaching
        self._stack: ExitStack | None = None
        self.pool: ArenaPool | None = None
        self.handout: Handout | None = None
        self.zeros: ZerosAsEmpty | None = None

    def __enter__(self) -> None:
        raw = self.arena.raw
        mapped = raw.numel() * raw.element_size()
        self.handout = Handout(raw.data_ptr(), _device_index(raw.device), kv_bytes(self.arena), mapped)
        if self.handout.mapped < self.handout.kv_bytes:
            raise LayoutMismatch(
                f"the arena maps {self.handout.mapped} bytes, less than its KV span {self.handout.kv_bytes}: this "
                "engine mapped another pool's arena than the one it asked the layout of; restart the engine"
            )
        self.zeros = ZerosAsEmpty(self.handout.kv_bytes)
        stack = ExitStack()
        self.pool = ArenaPool(self.handout)
        stack.enter_context(torch.cuda.use_mem_pool(self.pool.pool, device=self.arena.raw.device))
        if self.attaching:
            stack.enter_context(self.zeros)
        self._stack = stack

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        if kind is not None:
            return
        assert self.handout is not None
        why = (self.pool.error if self.pool is not None else None) or self.handout.missed()
        if why is not None:
            raise LayoutMismatch(f"kvpool: {why}")
        log.info(
            "kvpool: the engine's KV cache is the arena (%d bytes at %#x; %s)", self.handout.kv_bytes,
            self.handout.base, "attached to a live arena, not zeroed" if self.attaching else "zeroed",
        )  # fmt: skip


def arena_context(arena: ArenaLike, attaching: bool) -> ArenaContext:
    """The context the connector's ``get_mem_pool_context()`` returns (vLLM 0.31+, or 0.29-0.30 through
    :func:`install_backport`): inside it, vLLM's one KV backing allocation is the arena. ``attaching``: True while
    any other engine may hold KV in this arena. The pool zeroes a GPU arena when it creates it, so True is always
    right, and race-free where two engines start together; False (vLLM zeroes the arena, as it zeroes its own cache)
    only for the first engine on a fresh arena. Call :func:`check_plan` first (the connector's worker side, when it
    is built), :func:`install_backport` there too, and :func:`check_bound` in ``register_kv_caches``."""
    return ArenaContext(arena, attaching)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def missing() -> list[str]:
    """The vLLM and torch names this module relies on that this install lacks (empty: the memory side can make vLLM's
    KV the arena). The vLLM ones move between releases: the drift test runs this against each supported wheel."""
    import importlib

    need = [
        ("vllm.v1.worker.utils", "allocate_kv_cache"),
        ("vllm.v1.kv_cache_layout", "KVCacheLayout"),
        ("vllm.v1.kv_cache_interface", "KVCacheTensor"),
        ("vllm.distributed.kv_transfer", "get_kv_transfer_group"),
        ("vllm.distributed.kv_transfer", "has_kv_transfer_group"),
    ]
    gone = []
    for module, name in need:
        try:
            if not hasattr(importlib.import_module(module), name):
                gone.append(f"{module}.{name}")
        except ImportError:
            gone.append(f"{module}.{name}")
    if not gone and LAYOUT not in importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout.__members__:
        gone.append(f"vllm.v1.kv_cache_layout.KVCacheLayout.{LAYOUT}")
    if not gone and not has_hook():
        from vllm.v1.worker.gpu_worker import Worker

        if not hasattr(Worker, "_maybe_get_memory_pool_context"):
            gone.append("vllm.v1.worker.gpu_worker.Worker._maybe_get_memory_pool_context")
    if torch.cuda.is_available():
        gone += [f"torch.{n}" for n in ("_C._cuda_customAllocator", "cuda.MemPool", "cuda.use_mem_pool") if not _has(n)]
    return gone


def _has(dotted: str) -> bool:
    obj: Any = torch
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def has_hook() -> bool:
    """Whether this vLLM's worker asks the connector for the KV allocation context (0.31 and later)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    return hasattr(KVConnectorBase_V1, "get_mem_pool_context")


_lock = threading.Lock()


def install_backport() -> list[str]:
    """On vLLM 0.29-0.30, make the worker enter the connector's ``get_mem_pool_context()`` around its KV allocation,
    as 0.31's worker does; returns the vLLM attributes replaced (none on 0.31+, where the hook is vLLM's own). The
    connector's worker side calls it from its ``__init__``: vLLM builds the connector before it asks for the
    context."""
    if has_hook():
        return []
    from vllm.v1.worker.gpu_worker import Worker

    with _lock:
        original = Worker._maybe_get_memory_pool_context
        original = getattr(original, _WRAPPED, original)

        @functools.wraps(original)
        def context(worker: Any, tag: str) -> AbstractContextManager:
            if tag == "kv_cache":
                from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

                if has_kv_transfer_group():
                    ours = getattr(get_kv_transfer_group(), "get_mem_pool_context", lambda: None)()
                    if ours is not None:
                        return ours
            return original(worker, tag)

        setattr(context, _WRAPPED, original)
        Worker._maybe_get_memory_pool_context = context  # type: ignore[method-assign]
    return ["vllm.v1.worker.gpu_worker.Worker._maybe_get_memory_pool_context"]


def uninstall_backport() -> None:
    """Undo :func:`install_backport` (tests; a process that leaves resident mode)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:
        return
    with _lock:
        original = getattr(Worker._maybe_get_memory_pool_context, _WRAPPED, None)
        if original is not None:
            Worker._maybe_get_memory_pool_context = original  # type: ignore[method-assign]


def installed() -> list[str]:
    """The vLLM attributes this module has replaced in this process (empty on vLLM 0.31+)."""
    try:
        from vllm.v1.worker.gpu_worker import Worker
    except ImportError:
        return []
    replaced = getattr(Worker._maybe_get_memory_pool_context, _WRAPPED, None) is not None
    return ["vllm.v1.worker.gpu_worker.Worker._maybe_get_memory_pool_context"] if replaced else []


def kv_placement(worker: Any) -> dict[str, Any]:
    """Where this worker's KV caches are: each one's byte offset into the pool arena this process mapped that holds
    it (None: outside every arena), and the vLLM attributes replaced. Ask an engine with
    ``LLM.collective_rpc(kv_placement)``; a resident engine answers its layer regions' offsets and, on vLLM 0.31+,
    no attribute."""
    from kvpool import arena as arenas

    spans = [
        (a.raw.data_ptr(), a.raw.numel() * a.raw.element_size()) for a in list(arenas._mapped.values()) if not a.closed
    ]
    caches = getattr(worker.model_runner, "kv_caches", None) or []
    offsets: list[int | None] = []
    for cache in caches:
        for tensor in cache if isinstance(cache, (list, tuple)) else [cache]:
            ptr = tensor.data_ptr()
            offsets.append(next((ptr - base for base, size in spans if base <= ptr < base + size), None))
    return {"offsets": offsets, "replaced": installed()}
