"""The few CUDA runtime calls the arena needs, through ctypes on the libcudart that torch already loaded.

torch's own IPC path (``reduce_tensor``) exports per-storage handles with ref-counter files and events and
re-opens them per received tensor. The arena wants the opposite: one plain ``cudaMalloc`` allocation, one
64-byte handle exported once, opened once per process with ``cudaIpcOpenMemHandle`` and kept open.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

IPC_HANDLE_BYTES = 64
CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1


class CudaError(RuntimeError):
    pass


class IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * IPC_HANDLE_BYTES)]

    def to_bytes(self) -> bytes:
        # Not bytes(self.reserved): a c_char array reads as a C string and stops at the first zero byte.
        return ctypes.string_at(ctypes.addressof(self), IPC_HANDLE_BYTES)

    @classmethod
    def from_bytes(cls, handle: bytes) -> IpcMemHandle:
        if len(handle) != IPC_HANDLE_BYTES:
            raise CudaError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
        h = cls()
        ctypes.memmove(ctypes.addressof(h), handle, IPC_HANDLE_BYTES)
        return h


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def _find_cudart() -> ctypes.CDLL:
    import torch

    torch.cuda.init()
    major = (torch.version.cuda or "").split(".")[0]
    if major:
        try:  # the one torch loaded, found by its soname: reading /proc/self/maps costs milliseconds in a CUDA process
            return ctypes.CDLL(f"libcudart.so.{major}", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            pass
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if "libcudart" in path:
                return ctypes.CDLL(path)
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise CudaError("libcudart not found: torch was built without CUDA, or CUDA is not installed")


def cudart() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            lib = _find_cudart()
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcMemHandle, ctypes.c_uint]
            lib.cudaIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcMemHandle), ctypes.c_void_p]
            lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            lib.cudaFree.argtypes = [ctypes.c_void_p]
            lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
            lib.cudaMemGetInfo.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
            lib.cudaMemset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
            _lib = lib
        return _lib


def _check(code: int, what: str) -> None:
    if code != 0:
        message = cudart().cudaGetErrorString(code).decode()
        raise CudaError(f"{what} failed: {message} (cudaError {code})")


def set_device(index: int) -> None:
    _check(cudart().cudaSetDevice(index), f"cudaSetDevice({index})")


def malloc(nbytes: int) -> int:
    ptr = ctypes.c_void_p()
    _check(cudart().cudaMalloc(ctypes.byref(ptr), nbytes), f"cudaMalloc({nbytes})")
    assert ptr.value is not None
    return ptr.value


def free(ptr: int) -> None:
    _check(cudart().cudaFree(ctypes.c_void_p(ptr)), "cudaFree")


def zero(ptr: int, nbytes: int) -> None:
    """Fill device memory with zeros and wait for it (a new arena: vLLM's KV starts zeroed, and attention kernels
    may read a block's unwritten slots, which must hold numbers, not NaN bit patterns)."""
    _check(cudart().cudaMemset(ctypes.c_void_p(ptr), 0, nbytes), "cudaMemset")
    _check(cudart().cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def mem_get_info() -> tuple[int, int]:
    free_b, total = ctypes.c_size_t(), ctypes.c_size_t()
    _check(cudart().cudaMemGetInfo(ctypes.byref(free_b), ctypes.byref(total)), "cudaMemGetInfo")
    return free_b.value, total.value


def ipc_get_handle(ptr: int) -> bytes:
    handle = IpcMemHandle()
    _check(cudart().cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(ptr)), "cudaIpcGetMemHandle")
    return handle.to_bytes()


def ipc_open(handle: bytes) -> int:
    h = IpcMemHandle.from_bytes(handle)
    ptr = ctypes.c_void_p()
    _check(
        cudart().cudaIpcOpenMemHandle(ctypes.byref(ptr), h, CUDA_IPC_MEM_LAZY_ENABLE_PEER_ACCESS),
        "cudaIpcOpenMemHandle (same node? the arena's GPU visible? PID namespace shared with the pool?)",
    )
    assert ptr.value is not None
    return ptr.value


class DeviceBuffer:
    """A raw device pointer that torch can wrap without a copy (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.ptr = ptr
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3}


def device_uuid(index: int) -> str:
    import torch

    return str(torch.cuda.get_device_properties(index).uuid)


def ordinal_of(uuid: str) -> int:
    """The local ordinal of the GPU with ``uuid``: ordinals differ between processes, UUIDs do not."""
    import torch

    for i in range(torch.cuda.device_count()):
        if device_uuid(i) == uuid:
            return i
    raise CudaError(
        f"GPU {uuid} holds the arena but is not visible to this process (CUDA_VISIBLE_DEVICES?): "
        "every worker must see the arena's GPU"
    )
