"""Scattered blocks from one CUDA arena into another in one kernel, GPU to GPU or within one GPU.

A gather on the source, a copy of the gathered bytes and a scatter on the destination move every byte three times:
0.36-0.49x of a plain peer copy between two H200s. Here one Triton kernel on the destination's GPU reads each
(layer, block) span of the source over NVLink and writes it in place. On two H200s, through ``copy_blocks``
(``kvpool bench copy``): 0.88x and 0.92x of a plain peer copy at 1 and 4 GiB of 2 MiB blocks; of 32 KiB spans, 0.80x
and 0.87x at 256 and 768 MiB, 0.60x at 32 MiB, where the host's share (launch, ids, events) is as long as the
kernel's.

The kernel needs Triton (it comes with torch's CUDA builds) and the source's memory mapped for the destination's
GPU: the VMM mappings of workers and of the pool grant every peer GPU, and :func:`open_peers` enables peer access
for memory torch allocated. Where any of that is missing, :func:`copy` answers False, and :func:`move` gathers,
copies and scatters instead.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger(__name__)

#: int64 words a program moves per step (32 KiB), and the warps it moves them with
STEP, WARPS = 4096, 16
#: why the kernel failed once in this process (it is not tried again), or None
_broken: str | None = None


@functools.cache
def _kernel() -> Any | None:
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        log.debug("no Triton (%s): blocks between GPU arenas are gathered, copied and scattered", exc)
        return None

    # n (blocks in this copy) changes with every copy: a value Triton specialized on (1, a multiple of 16) would
    # build the kernel again, a second or so, in the middle of a lookup
    @triton.jit(do_not_specialize=["n"])
    def copy_spans(src, dst, ids, n, src_outer, dst_outer, span, STEP: tl.constexpr):
        pair = tl.program_id(0)
        outer = tl.program_id(1).to(tl.int64)
        s = src + outer * src_outer + tl.load(ids + pair) * span
        d = dst + outer * dst_outer + tl.load(ids + n + pair) * span
        for start in range(0, span, STEP):
            at = start + tl.arange(0, STEP)
            keep = at < span
            tl.store(d + at, tl.load(s + at, mask=keep), mask=keep)

    return copy_spans


def geometry(view: torch.Tensor, dim: int) -> tuple[int, int, int] | None:
    """(slices, blocks, int64 words of a block in one slice) of a blocks view, or None where the kernel cannot
    move it (not contiguous, blocks on another dim, spans that are not whole words)."""
    if dim not in (0, 1) or not view.is_contiguous():
        return None
    span_bytes = math.prod(view.shape[dim + 1 :]) * view.element_size()
    if span_bytes % 8:
        return None
    return (view.shape[0] if dim == 1 else 1), view.shape[dim], span_bytes // 8


@functools.cache
def reaches(a: int, b: int) -> bool:
    """Whether GPU ``a`` can read GPU ``b``'s memory (peer access over NVLink or PCIe): a kernel reading memory it
    cannot reach would end the process's CUDA context, so without it the copy goes through the gather."""
    import torch

    return a == b or torch.cuda.can_device_access_peer(a, b)


@functools.cache
def open_peers(a: int, b: int) -> None:
    """Enable peer access between two GPUs for memory torch allocated (torch does so for a copy between them that
    is not one contiguous span); VMM mappings carry their own grants."""
    import torch

    if a == b:
        return
    x = torch.zeros(2, 2, device=f"cuda:{a}")
    y = torch.zeros(2, 2, device=f"cuda:{b}")
    y.t().copy_(x.t()[:, :])
    x.t().copy_(y.t()[:, :])


class Route:
    """What a copy between two blocks views needs that does not change while both stay mapped: the views as words
    on the destination's GPU, the grid's second dim, the strides, and the kernel as built for them. Looked up once
    per copy, so that a request's copy pays for its ids and one launch, not for checks it passed before."""

    def __init__(self, kernel: Any, src: torch.Tensor, dst: torch.Tensor, gs: tuple[int, int, int],
                 gd: tuple[int, int, int]) -> None:  # fmt: skip
        self.device = dst.device
        self.words_src = _words(src.data_ptr(), src.nbytes, self.device.index)
        self.words_dst = _words(dst.data_ptr(), dst.nbytes, self.device.index)
        self.kernel, self.slices, self.span = kernel, gs[0], gs[2]
        self.blocks = gs[1], gd[1]
        self.outer = gs[1] * gs[2], gd[1] * gd[2]
        self.built: Any = None  # the kernel as Triton built it for this route's arguments, once launched

    def launch(self, ids: torch.Tensor, n: int) -> None:
        """Launch on the current stream of the destination's GPU (the caller's device context)."""
        args = (self.words_src, self.words_dst, ids, n, *self.outer, self.span)
        if self.built is not None:  # Triton's own launch binds and checks every argument again: tens of us
            try:
                self.built[(n, self.slices, 1)](*args, STEP)
                return
            except Exception as exc:  # another Triton's compiled-kernel API: its own launch from now on
                log.debug("launching the built copy kernel failed (%s); launching through Triton's JIT", exc)
                self.built = False
        built = self.kernel[(n, self.slices)](*args, STEP=STEP, num_warps=WARPS)
        if self.built is None:
            self.built = built


_routes: dict[tuple[Any, ...], Route | None] = {}


def _route(src: torch.Tensor, dst: torch.Tensor, dim: int) -> Route | None:
    key = (src.data_ptr(), src.shape, src.dtype, src.device, dst.data_ptr(), dst.shape, dst.dtype, dst.device, dim)
    route = _routes.get(key, False)
    if route is not False:
        return route
    kernel = _kernel()
    gs, gd = geometry(src, dim), geometry(dst, dim)
    route = None
    fits = kernel is not None and gs is not None and gd is not None and gs[0] == gd[0] and gs[2] == gd[2]
    if fits and reaches(dst.device.index, src.device.index):
        open_peers(src.device.index, dst.device.index)
        route = Route(kernel, src, dst, gs, gd)  # type: ignore[arg-type]
    if len(_routes) > 256:
        _routes.clear()
    _routes[key] = route
    return route


def copy(src: torch.Tensor, src_ids: Sequence[int] | np.ndarray, dst: torch.Tensor, dst_ids: Sequence[int] | np.ndarray,
         dim: int) -> bool:  # fmt: skip
    """Copy blocks ``src_ids`` of the blocks view ``src`` into blocks ``dst_ids`` of ``dst`` (both indexed on
    ``dim``), on the destination's current stream; False (nothing done) where the kernel cannot.

    What the host does around the kernel counts as much as the kernel at a request's size (a 32 MiB copy takes
    about 120 us): the ids go over as one int64 array from pinned memory, without waiting for the copy."""
    import torch

    global _broken
    n = len(src_ids)
    if not (src.is_cuda and dst.is_cuda) or not n or _broken is not None:
        return False
    route = _route(src, dst, dim)
    if route is None:
        return False
    pairs = torch.empty(2 * n, dtype=torch.int64, pin_memory=True)
    both = pairs.numpy()
    both[:n], both[n:] = src_ids, dst_ids
    src_blocks, dst_blocks = route.blocks
    if both.min() < 0 or both[:n].max() >= src_blocks or both[n:].max() >= dst_blocks:
        raise IndexError(f"blocks outside the arenas ({src_blocks} and {dst_blocks} blocks)")
    try:
        with torch.cuda.device(route.device):
            route.launch(pairs.to(route.device, non_blocking=True), n)  # the host allocator keeps ``pairs`` till then
    except Exception as exc:  # Triton cannot build or launch it here (no compiler, no cache dir): the old way
        _broken = f"{type(exc).__name__}: {exc}"
        log.warning("block copies by kernel turned off (%s): gathering, copying and scattering instead", _broken)
        return False
    return True


def move(src: torch.Tensor, src_ids: Sequence[int] | np.ndarray, dst: torch.Tensor, dst_ids: Sequence[int] | np.ndarray,
         dim: int) -> None:  # fmt: skip
    """Copy blocks ``src_ids`` of the blocks view ``src`` into blocks ``dst_ids`` of ``dst``: by the kernel where
    :func:`copy` can run it, else one gather, one copy to the destination's device and one scatter; on CUDA,
    ordered on the destination's current stream."""
    if copy(src, src_ids, dst, dst_ids, dim):
        return
    import torch

    staged = src.index_select(dim, torch.as_tensor(src_ids, dtype=torch.int64).to(src.device))
    dst_idx = torch.as_tensor(dst_ids, dtype=torch.int64).to(dst.device)
    dst.index_copy_(dim, dst_idx, staged.to(dst.device, non_blocking=True))


@functools.lru_cache(maxsize=64)
def _words(ptr: int, nbytes: int, device: int) -> torch.Tensor:
    """The bytes at ``ptr`` as int64 words (the kernel's unit) in a tensor of ``device``: an alias of peer memory
    where they are on another GPU (the kernel runs on ``device`` and reads them there). Arenas never move while
    mapped, so each view is cut once."""
    import torch

    from kvpool.cuda import DeviceBuffer

    return torch.as_tensor(DeviceBuffer(ptr, nbytes), device=f"cuda:{device}").view(torch.int64)
