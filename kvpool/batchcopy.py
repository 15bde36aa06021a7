"""The plan of a block copy as byte ranges, and the copy as one ``cuMemcpyBatchAsync`` call.

A request's blocks are scattered over an arena, and in every layer (:meth:`kvpool.arena.Arena.blocks_view`). Copied
as a gather on the source, a copy of the gathered bytes and a scatter on the destination, they cross memory twice
more than a plain copy, through a staging buffer, and the gather and scatter take SM time. Planned as byte ranges
instead (one per block and layer, a run of consecutive ids on both sides merged into one range), a request's copy
is one driver call (CUDA 12.8 and later): the copy engines move every range straight from one arena into the other,
GPU to GPU or within one GPU, with no kernel and no staging bytes. A copy of gigabytes is cut into calls of
:data:`MAX_RANGES` ranges, so that the copy engines are busy with the first while Python plans the next.

The planner is pure Python on integers, so CI checks it on CPU tensors (applying a plan with ``memmove``); the
driver call is reached through ``cuGetProcAddress`` on ``libcuda`` (:func:`kvpool.vmm.proc_address`). Where the
driver has no batch copy, :func:`available` is False and callers keep the gather, copy and scatter.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.cuda import CudaError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: the driver's ``CUmemcpySrcAccessOrder``: the source is read in stream order, after the work queued before it
CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
#: the CUDA version whose ``cuMemcpyBatchAsync`` is asked for: 12.8's, which takes ``size_t* failIdx``
BATCH_CUDA_VERSION = 12080
#: ranges in one call at most: a request (64 blocks of 16 layers: 1,024) is one call; a copy of gigabytes goes in
#: calls of this many, so that the copy engines start on the first while the rest are planned (30 ns a range)
MAX_RANGES = 8192


@dataclass(frozen=True)
class Geometry:
    """Where the blocks of a contiguous blocks view lie: ``outer`` slices of ``num_blocks`` blocks of
    ``block_bytes`` each (a layer's K, V or both per slice when blocks index dim 1; one slice on dim 0)."""

    outer: int
    num_blocks: int
    block_bytes: int

    @classmethod
    def of(cls, shape: Sequence[int], dim: int, itemsize: int) -> Geometry:
        if dim not in (0, 1) or len(shape) <= dim:
            raise ValueError(f"blocks on dim {dim} of a view shaped {tuple(shape)}: only dim 0 or 1 is planned")
        return cls(math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :]) * itemsize)

    @classmethod
    def of_view(cls, view: torch.Tensor, dim: int) -> Geometry:
        if not view.is_contiguous():
            raise ValueError("a blocks view must be contiguous to be planned as byte ranges")
        return cls.of(tuple(view.shape), dim, view.element_size())

    @property
    def outer_bytes(self) -> int:
        """Bytes from one outer slice to the next."""
        return self.num_blocks * self.block_bytes


@dataclass(frozen=True)
class Plan:
    """Source and destination addresses and sizes of each byte range, as the driver takes them (uint64 arrays)."""

    srcs: array
    dsts: array
    sizes: array

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source id, first destination id, length) of each run of pairs whose ids both step by one, the pairs
    taken in the order of their source ids (the allocator often hands out consecutive ids)."""
    n = len(src_ids)
    if n and n == len(dst_ids) and _consecutive(src_ids) and _consecutive(dst_ids):
        return [(src_ids[0], dst_ids[0], n)]
    out: list[tuple[int, int, int]] = []
    last_s = last_d = -2
    for s, d in sorted(zip(src_ids, dst_ids, strict=True)):
        if s == last_s + 1 and d == last_d + 1:
            first_s, first_d, length = out[-1]
            out[-1] = (first_s, first_d, length + 1)
        else:
            out.append((s, d, 1))
        last_s, last_d = s, d
    return out


def _consecutive(ids: Sequence[int]) -> bool:
    first = ids[0]
    return ids[-1] - first == len(ids) - 1 and list(ids) == list(range(first, first + len(ids)))


class Planner:
    """A copy's runs (:func:`runs`), checked once, and the plans of its outer slices, all or some at a time."""

    def __init__(
        self, src_ids: Sequence[int], dst_ids: Sequence[int], src: Geometry, dst: Geometry, src_base: int = 0,
        dst_base: int = 0,
    ) -> None:  # fmt: skip
        if src.outer != dst.outer or src.block_bytes != dst.block_bytes:
            raise ValueError(f"views of different block geometries: {src} against {dst}")
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks against {len(dst_ids)} destination blocks")
        spans = runs(src_ids, dst_ids)
        if spans:
            src_span = (spans[0][0], spans[-1][0] + spans[-1][2])  # runs come in the order of their source ids
            dst_span = (min(d for _, d, _ in spans), max(d + n for _, d, n in spans))
            for (lo, end), ids, g, side in (
                (src_span, src_ids, src, "source"),
                (dst_span, dst_ids, dst, "destination"),
            ):
                if lo < 0 or end > g.num_blocks:
                    raise IndexError(f"{side} blocks outside [0, {g.num_blocks}): {list(ids)[:8]}")
        bb = src.block_bytes
        self.outer = src.outer
        self._src = ([s * bb for s, _, _ in spans], src_base, src.outer_bytes)
        self._dst = ([d * bb for _, d, _ in spans], dst_base, dst.outer_bytes)
        self._sizes = array("Q", [n * bb for _, _, n in spans])

    @property
    def per_slice(self) -> int:
        """Ranges in each outer slice: one per run."""
        return len(self._sizes)

    def plan(self, first: int = 0, stop: int | None = None) -> Plan:
        """The ranges of outer slices ``first`` up to ``stop`` (all of them by default), slice by slice."""
        stop = self.outer if stop is None else stop
        (s_off, s_base, s_step), (d_off, d_base, d_step) = self._src, self._dst
        return Plan(
            _spread(s_off, range(s_base + first * s_step, s_base + stop * s_step, s_step)),
            _spread(d_off, range(d_base + first * d_step, d_base + stop * d_step, d_step)),
            self._sizes * (stop - first),
        )


def plan(
    src_ids: Sequence[int], dst_ids: Sequence[int], src: Geometry, dst: Geometry, src_base: int = 0, dst_base: int = 0
) -> Plan:
    """The byte ranges that copy blocks ``src_ids`` of a view shaped like ``src`` at address ``src_base`` into
    blocks ``dst_ids`` of a view shaped like ``dst`` at ``dst_base`` (pairwise), every outer slice: one range per
    run of consecutive ids (:func:`runs`) and slice, in slice order. Ids are local to each view; one outside it is
    refused here, where a wrong address would write over memory that is no block's."""
    return Planner(src_ids, dst_ids, src, dst, src_base, dst_base).plan()


def _spread(offsets: list[int], bases: range) -> array:
    """Every base plus every offset, base by base, as uint64s: a request of 64 scattered blocks of 16 layers is 1,024
    addresses, built in a quarter of the time a comprehension takes. The offsets are packed into one integer of
    64-bit lanes, and adding ``base * ones`` (``base`` in every lane) adds a base to all of them at once: addresses
    fit in 64 bits, so no carry crosses a lane."""
    order = sys.byteorder
    width = 8 * len(offsets)
    ones = ((1 << (8 * width)) - 1) // ((1 << 64) - 1)
    lanes = int.from_bytes(array("Q", offsets).tobytes(), order) + bases.start * ones
    step = bases.step * ones
    chunks = []
    for _ in bases:
        chunks.append(lanes.to_bytes(width, order))
        lanes += step
    out = array("Q")
    out.frombytes(b"".join(chunks))
    return out


# -- the driver call ----------------------------------------------------------------------------------------------


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` (v1): the location hints matter only for managed or host memory, left empty."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", MemLocation),
        ("dstLocHint", MemLocation),
        ("flags", ctypes.c_uint),
    ]


# CUresult cuMemcpyBatchAsync(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count,
#     CUmemcpyAttributes* attrs, size_t* attrsIdxs, size_t numAttrs, size_t* failIdx, CUstream hStream)  [12.8]
_BatchFn = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
)

#: one attributes entry for every range of a batch (``attrsIdxs = [0]``)
_ATTRS = MemcpyAttributes(srcAccessOrder=CU_MEMCPY_SRC_ACCESS_ORDER_STREAM)
_ATTRS_IDX = (ctypes.c_size_t * 1)(0)

_lock = threading.Lock()
_resolved = False
_fn: Callable[..., int] | None = None
_why_not: str | None = None
_streams: dict[int, torch.cuda.Stream] = {}


def function() -> Callable[..., int] | None:
    """The driver's ``cuMemcpyBatchAsync`` of CUDA 12.8, resolved once; None where this driver (or machine) lacks
    it, said once in the debug log."""
    global _resolved, _fn, _why_not
    if _resolved:
        return _fn
    with _lock:
        if not _resolved:
            from kvpool import vmm

            address, why = vmm.proc_address("cuMemcpyBatchAsync", BATCH_CUDA_VERSION)
            if address is None:
                _why_not = why
                log.debug("no batch copies (%s): blocks between GPU arenas are gathered, copied and scattered", why)
            else:
                _fn = _BatchFn(address)
            _resolved = True
    return _fn


def available() -> bool:
    """Whether block copies between GPU arenas go through one ``cuMemcpyBatchAsync`` call in this process."""
    return function() is not None and _why_not is None


def why_not() -> str | None:
    """Why :func:`available` is False (the driver lacks the call, or a call failed), or None."""
    function()
    return _why_not


def _disable(why: str) -> None:
    global _why_not
    _why_not = why
    log.warning("batch copies turned off for this process (%s): copying blocks by gather, copy and scatter", why)


def issue(p: Plan, stream: int) -> None:
    """Queue the plan's copies on ``stream`` (a ``CUstream`` handle; never 0: the driver refuses the legacy default
    stream) as one driver call; the sources are read in stream order."""
    from kvpool import vmm

    fn = function()
    if fn is None:
        raise CudaError(f"cuMemcpyBatchAsync is not available: {_why_not}")
    if not stream:
        raise ValueError("cuMemcpyBatchAsync refuses the legacy default stream: issue on a stream of your own")
    if not p.count:
        return
    lib, ctx, fail = vmm.driver(), ctypes.c_void_p(), ctypes.c_size_t(0)
    vmm.check(lib.cuStreamGetCtx(stream, ctypes.byref(ctx)), "cuStreamGetCtx")
    vmm.check(lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")  # the stream's context, whichever thread this is
    try:
        code = fn(
            p.dsts.buffer_info()[0],
            p.srcs.buffer_info()[0],
            p.sizes.buffer_info()[0],
            p.count,
            ctypes.addressof(_ATTRS),
            ctypes.addressof(_ATTRS_IDX),
            1,
            ctypes.addressof(fail),
            stream,
        )
    finally:
        lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    if code != 0:
        at = f"at range {fail.value} of {p.count}" if fail.value < p.count else f"{p.count} ranges"
        vmm.check(code, f"cuMemcpyBatchAsync ({at})")


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """A stream of this module's own on ``device``, for callers whose current stream is the legacy default one."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get(index)
    if stream is None:
        stream = _streams.setdefault(index, torch.cuda.Stream(device=index))
    return stream


def copy(
    src: torch.Tensor,
    src_ids: Sequence[int],
    dst: torch.Tensor,
    dst_ids: Sequence[int],
    dim: int,
    stream: torch.cuda.Stream,
) -> bool:
    """Queue the copy of blocks ``src_ids`` of blocks view ``src`` into blocks ``dst_ids`` of ``dst`` (CUDA views
    as :meth:`kvpool.arena.Arena.blocks_view` cuts them, blocks on ``dim``, local ids) on ``stream``, a stream of
    the destination's device that is not the legacy default one. False where the caller must copy another way: no
    batch copy in this driver (or one failed before), or blocks of the same arena that are both read and written
    (a gather reads them all before it writes; a batch of ranges does not promise to). Nothing is queued then,
    unless a call failed after earlier calls of the same copy: order what comes next after ``stream`` all the same
    (those ranges hold the bytes the caller's own copy writes)."""
    if not available():
        return False
    if src.data_ptr() == dst.data_ptr() and not set(src_ids).isdisjoint(dst_ids):
        return False
    planner = Planner(src_ids, dst_ids, Geometry.of_view(src, dim), Geometry.of_view(dst, dim), src.data_ptr(),
                      dst.data_ptr())  # fmt: skip
    per_call = max(1, MAX_RANGES // max(1, planner.per_slice))
    try:
        for first in range(0, planner.outer, per_call):
            issue(planner.plan(first, min(first + per_call, planner.outer)), stream.cuda_stream)
    except CudaError as exc:
        _disable(str(exc))
        return False
    return True
