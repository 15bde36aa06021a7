"""The arena as one CUDA VMM allocation, shared as a POSIX file descriptor: the driver calls, through ctypes.

A legacy IPC handle is 64 bytes that anyone who learns them can open, and it fails between processes with the
same PID in separate PID namespaces. A ``cuMemCreate`` allocation exported as a file descriptor is a kernel
object: only a process that was handed the fd (SCM_RIGHTS on the pool's Unix socket) can import it, and PIDs
play no part. The pool creates and exports; each worker imports, reserves an address range, maps and grants
access once, and keeps the mapping for the life of the process.

The driver API is reached through ``libcuda.so.1`` directly: it is present wherever a GPU is, and the calls are
few enough not to need a binding package.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable

from kvpool.cuda import CudaError

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
GRANULARITY_RECOMMENDED = 1
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110


class MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_u64, _size, _p = ctypes.c_ulonglong, ctypes.c_size_t, ctypes.POINTER


def driver() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaError(f"the CUDA driver (libcuda.so.1) cannot be loaded: {exc}") from None
            lib.cuGetErrorString.argtypes = [ctypes.c_int, _p(ctypes.c_char_p)]
            lib.cuDeviceGetAttribute.argtypes = [_p(ctypes.c_int), ctypes.c_int, ctypes.c_int]
            lib.cuDeviceCanAccessPeer.argtypes = [_p(ctypes.c_int), ctypes.c_int, ctypes.c_int]
            lib.cuMemGetAllocationGranularity.argtypes = [_p(_size), _p(AllocationProp), ctypes.c_int]
            lib.cuMemCreate.argtypes = [_p(_u64), _size, _p(AllocationProp), _u64]
            lib.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, _u64, ctypes.c_int, _u64]
            lib.cuMemImportFromShareableHandle.argtypes = [_p(_u64), ctypes.c_void_p, ctypes.c_int]
            lib.cuMemAddressReserve.argtypes = [_p(_u64), _size, _size, _u64, _u64]
            lib.cuMemMap.argtypes = [_u64, _size, _size, _u64, _u64]
            lib.cuMemSetAccess.argtypes = [_u64, _size, _p(AccessDesc), _size]
            lib.cuMemUnmap.argtypes = [_u64, _size]
            lib.cuMemAddressFree.argtypes = [_u64, _size]
            lib.cuMemRelease.argtypes = [_u64]
            lib.cuDeviceGet.argtypes = [_p(ctypes.c_int), ctypes.c_int]
            lib.cuDeviceGetCount.argtypes = [_p(ctypes.c_int)]
            lib.cuDeviceGetUuid.argtypes = [_p(ctypes.c_ubyte * 16), ctypes.c_int]
            lib.cuDevicePrimaryCtxRetain.argtypes = [_p(ctypes.c_void_p), ctypes.c_int]
            lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
            _check_with(lib, lib.cuInit(0), "cuInit")
            _lib = lib
        return _lib


def _check_with(lib: ctypes.CDLL, code: int, what: str) -> None:
    if code != 0:
        text = ctypes.c_char_p()
        lib.cuGetErrorString(code, ctypes.byref(text))
        message = text.value.decode() if text.value else "unknown error"
        raise CudaError(f"{what} failed: {message} (CUresult {code})")


def _check(code: int, what: str) -> None:
    _check_with(driver(), code, what)


def _prop(device: int, rdma: bool = False) -> AllocationProp:
    prop = AllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, device)
    prop.allocFlags.gpuDirectRDMACapable = int(rdma)
    return prop


def rdma_capable(device: int) -> bool:
    """Whether ``device`` lets VMM memory be allocated GPUDirect RDMA-capable, so that a NIC (NIXL over UCX, a peer
    pool's read) reads and writes the arena itself: without the flag UCX falls back to staging it (NIXL issue 1754:
    0.3 GB/s against about 200 GB/s on cudaMalloc memory). The pool's arena asks for it wherever it can."""
    value, attr = ctypes.c_int(), CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    return driver().cuDeviceGetAttribute(ctypes.byref(value), attr, device) == 0 and bool(value.value)


def supported(device: int) -> str | None:
    """None if ``device`` can export VMM memory as a POSIX fd; otherwise why not, in words."""
    try:
        lib = driver()
    except CudaError as exc:
        return str(exc)
    for attr, what in (
        (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management"),
        (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, "POSIX file descriptor handles"),
    ):
        value = ctypes.c_int()
        code = lib.cuDeviceGetAttribute(ctypes.byref(value), attr, device)
        if code != 0 or not value.value:
            return f"device {device} does not support {what}"
    return None


def granularity(device: int, rdma: bool = False) -> int:
    g = _size()
    prop = _prop(device, rdma)
    code = driver().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), GRANULARITY_RECOMMENDED)
    _check(code, "cuMemGetAllocationGranularity")
    return g.value


def round_up(nbytes: int, device: int) -> int:
    g = granularity(device, rdma_capable(device))
    return (nbytes + g - 1) // g * g


def create(nbytes: int, device: int) -> int:
    """A physical allocation of ``nbytes`` (a multiple of the granularity) on ``device``, RDMA-capable where the
    device allows (:func:`rdma_capable`); unmapped."""
    handle = _u64()
    prop = _prop(device, rdma_capable(device))
    _check(driver().cuMemCreate(ctypes.byref(handle), nbytes, ctypes.byref(prop), 0), f"cuMemCreate({nbytes})")
    return handle.value


def export_fd(handle: int) -> int:
    fd = ctypes.c_int(-1)
    _check(
        driver().cuMemExportToShareableHandle(ctypes.byref(fd), handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
        "cuMemExportToShareableHandle",
    )
    return fd.value


def release(handle: int) -> None:
    _check(driver().cuMemRelease(handle), "cuMemRelease")


def use_device(device: int) -> None:
    """Make ``device``'s primary context, the one torch and the CUDA runtime use, current on this thread for the
    driver calls that follow (what ``cudaSetDevice`` does, without loading the runtime's library for it). The
    context stays retained, as the runtime keeps it, for the life of the process."""
    lib, dev, ctx = driver(), ctypes.c_int(), ctypes.c_void_p()
    _check(lib.cuDeviceGet(ctypes.byref(dev), device), f"cuDeviceGet({device})")
    _check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    _check(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def ordinal_of(uuid: str) -> int | None:
    """The local ordinal of the GPU with ``uuid`` (as torch writes it: 8-4-4-4-12 hex), asked of the driver, which
    numbers the visible GPUs as torch does; None if no GPU has it. torch's own answer reads every GPU's
    properties first, a fifth of a millisecond of an arena's attach."""
    lib, count, dev, raw = driver(), ctypes.c_int(), ctypes.c_int(), (ctypes.c_ubyte * 16)()
    _check(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    for index in range(count.value):
        if lib.cuDeviceGet(ctypes.byref(dev), index) or lib.cuDeviceGetUuid(ctypes.byref(raw), dev):
            continue
        h = bytes(raw).hex()
        if f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" == uuid:
            return index
    return None


def peers(device: int) -> list[int]:
    """``device`` and every visible device that can reach it as a peer: all may then read and write the mapping.
    The driver counts them (as torch does, under ``CUDA_VISIBLE_DEVICES``) in microseconds, where
    ``torch.cuda.device_count()`` took a tenth of a millisecond of an attach."""
    lib, out, count = driver(), [device], ctypes.c_int()
    _check(lib.cuDeviceGetCount(ctypes.byref(count)), "cuDeviceGetCount")
    for other in range(count.value):
        ok = ctypes.c_int()
        if other != device and lib.cuDeviceCanAccessPeer(ctypes.byref(ok), other, device) == 0 and ok.value:
            out.append(other)
    return out


def import_map(
    fd: int, nbytes: int, device: int, access: list[int] | None = None, granting: Callable[[int], object] | None = None
) -> int:
    """Import the allocation behind ``fd`` and map all ``nbytes`` of it; returns the device pointer.

    ``fd`` is consumed (closed). The imported handle is released once mapped: the mapping holds the memory, and
    :func:`unmap` (or the process's exit) lets it go. ``granting`` is called with the pointer right before the
    driver grants access, which takes milliseconds for a large arena with the GIL let go: work on another thread
    can use them, as long as it does not touch the memory.
    """
    handle = _u64()
    try:
        lib = driver()
        _check(
            lib.cuMemImportFromShareableHandle(
                ctypes.byref(handle), ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            ),
            "cuMemImportFromShareableHandle",
        )
    finally:
        os.close(fd)
    ptr = _u64()
    try:
        _check(lib.cuMemAddressReserve(ctypes.byref(ptr), nbytes, granularity(device), 0, 0), "cuMemAddressReserve")
        try:
            _check(lib.cuMemMap(ptr.value, nbytes, 0, handle.value, 0), "cuMemMap")
            devices = access or [device]
            descs = (AccessDesc * len(devices))(
                *(AccessDesc(MemLocation(CU_MEM_LOCATION_TYPE_DEVICE, d), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                  for d in devices)
            )  # fmt: skip
            if granting is not None:
                granting(ptr.value)
            code = lib.cuMemSetAccess(ptr.value, nbytes, descs, len(devices))
            if code != 0:
                lib.cuMemUnmap(ptr.value, nbytes)
                _check(code, "cuMemSetAccess")
        except BaseException:
            lib.cuMemAddressFree(ptr.value, nbytes)
            raise
    finally:
        lib.cuMemRelease(handle.value)
    return ptr.value


def unmap(ptr: int, nbytes: int) -> None:
    _check(driver().cuMemUnmap(ptr, nbytes), "cuMemUnmap")
    _check(driver().cuMemAddressFree(ptr, nbytes), "cuMemAddressFree")
