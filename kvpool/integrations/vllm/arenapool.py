"""The torch memory pool whose one large allocation is the arena: how vLLM 0.29+'s KV backing becomes the arena's
bytes without vLLM knowing (:mod:`.memory` enters it around vLLM's allocation).

torch routes a ``torch.cuda.MemPool``'s new segments to the pool's allocator; :class:`Handout` decides which request
is the KV backing (pure books), and :class:`ArenaPool` is the allocator, two ctypes callbacks, so no compiler is
needed.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

#: what the caching allocator asks a pool's allocator for, torch 2.13-2.14 (``CUDACachingAllocator.cpp``
#: ``round_size`` and ``get_allocation_size``): the request rounded up to 512 bytes, then to a 2 MiB segment above
#: 1 MiB and 10 MiB, or the fixed 2 MiB / 20 MiB buffers below
_MIN_BLOCK, _ROUND_LARGE = 512, 2 << 20
_SMALL, _MIN_LARGE = 1 << 20, 10 << 20
_SMALL_BUFFER, _LARGE_BUFFER = 2 << 20, 20 << 20
#: the CUDA callbacks and pools handed to torch: C++ holds their addresses for the life of the process
_KEEP: list[Any] = []


def segment_bytes(nbytes: int) -> int:
    """The segment torch's caching allocator asks a pool's allocator for, to serve a tensor of ``nbytes``."""
    size = max(_MIN_BLOCK, -(-nbytes // _MIN_BLOCK) * _MIN_BLOCK)
    if size <= _SMALL:
        return _SMALL_BUFFER
    if size < _MIN_LARGE:
        return _LARGE_BUFFER
    return -(-size // _ROUND_LARGE) * _ROUND_LARGE


class Handout:
    """Which of the pool allocator's requests gets the arena: the first one on the arena's device whose size is the
    segment torch asks for the arena's KV span (or the span itself, up to the mapping). Everything else is not the
    KV backing, and gets ordinary memory. Pure books, so the rule is testable without a GPU."""

    def __init__(self, base: int, device: int, kv_bytes: int, mapped: int) -> None:
        self.base, self.device, self.kv_bytes, self.mapped = base, device, kv_bytes, mapped
        self.handed = False
        self.others: list[int] = []

    def take(self, size: int, device: int) -> int | None:
        """The arena's base for the KV backing, None for any other request."""
        fits = self.kv_bytes <= size <= max(self.mapped, segment_bytes(self.kv_bytes))
        if not self.handed and device == self.device and fits:
            self.handed = True
            return self.base
        self.others.append(size)
        return None

    def missed(self) -> str | None:
        """Why the arena did not become vLLM's KV backing (None: it did)."""
        if self.handed:
            return None
        asked = ", ".join(str(s) for s in self.others) or "nothing"
        return (
            f"vLLM's KV allocation did not fit the arena (the pool allocator was asked for {asked} bytes; the "
            f"arena's KV span is {self.kv_bytes} bytes, segment {segment_bytes(self.kv_bytes)}, mapped "
            f"{self.mapped}): start vLLM with the pool's --num-gpu-blocks-override, block size and dtype, with no "
            "sleep mode or cumem allocator, and with the arena's GPU as its device"
        )


_MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


def _custom_allocator(malloc: Any, free: Any) -> Any:
    """torch's allocator object over two C function pointers, ``void* malloc(size_t, int device, cudaStream_t)`` and
    ``void free(void*, size_t, int device, cudaStream_t)``: the one private torch symbol kvpool uses
    (``CUDAPluggableAllocator`` wants a .so path; this takes pointers, so no compiler is needed)."""
    return torch._C._cuda_customAllocator(
        ctypes.cast(malloc, ctypes.c_void_p).value, ctypes.cast(free, ctypes.c_void_p).value
    )


class ArenaPool:
    """A ``torch.cuda.MemPool`` whose allocator serves the KV backing from the arena (:class:`Handout`) and anything
    else with ``cudaMalloc``; freeing the arena is a no-op. The callbacks run inside torch's allocator, under its
    lock, and take the GIL: they never raise (an exception would come back to C++ as a null pointer), keep what went
    wrong for the context's exit, and run only while vLLM's worker allocates its KV cache, before it serves."""

    def __init__(self, handout: Handout) -> None:
        from kvpool import cuda

        self.handout = handout
        self.own: dict[int, int] = {}
        self.error: str | None = None

        def malloc(size: int, device: int, stream: int) -> int:
            try:
                ptr = handout.take(int(size), int(device))
                if ptr is None:
                    ptr = cuda.malloc(int(size))
                    self.own[ptr] = int(size)
                return ptr
            except BaseException as exc:  # a raise here is a null pointer in C++
                self.error = f"{type(exc).__name__}: {exc}"
                return 0

        def free(ptr: int | None, size: int, device: int, stream: int) -> None:
            try:
                if ptr and self.own.pop(int(ptr), None) is not None:
                    cuda.free(int(ptr))
            except BaseException as exc:
                self.error = f"{type(exc).__name__}: {exc}"

        self._callbacks = (_MALLOC(malloc), _FREE(free))
        self.allocator = _custom_allocator(*self._callbacks)
        try:
            self.pool = torch.cuda.MemPool(self.allocator, no_split=True)  # the segment past the KV is no one's
        except TypeError:  # torch before 2.13 (vLLM 0.29+ pins 2.13+): nothing else allocates in the context
            self.pool = torch.cuda.MemPool(self.allocator)
        _KEEP.append(self)
