"""The pool's CUDA arena as one VMM allocation, exported once as a POSIX file descriptor.

The pool creates the physical memory and exports it; it never maps it, as it never maps a legacy arena either.
Workers get the fd from the fast channel (SCM_RIGHTS, after hello, for a live session) and map it themselves.
The memory lives until the pool has released its handle and every worker has unmapped it (or exited), so a pool
that stops first cannot pull the memory from under a worker's kernels.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

from kvpool.errors import InvalidRequest
from kvpool.protocol import DeviceInfo
from kvpool.server.arenas import ArenaHandle, HostArena

log = logging.getLogger(__name__)


def resolve_handle(setting: ArenaHandle, device: int, fd_passing: bool) -> Literal["vmm", "legacy"]:
    """The handle kind the arena on ``device`` gets: ``auto`` prefers VMM where the GPU and the pool allow it."""
    if setting == "legacy":
        return "legacy"
    if not fd_passing:
        if setting == "vmm":
            raise InvalidRequest(
                "--arena-handle vmm hands the arena's fd over the fast channel's Unix socket, and this pool serves "
                "none: give --socket and keep --fast-channel on, or use --arena-handle legacy (or auto)"
            )
        log.info("arena handle: legacy CUDA IPC (no fast channel on a Unix socket to pass a VMM fd over)")
        return "legacy"
    from kvpool import vmm

    why = vmm.supported(device)
    if why is not None:
        if setting == "vmm":
            raise InvalidRequest(f"--arena-handle vmm: {why}; use --arena-handle legacy (or auto)")
        log.info("arena handle: legacy CUDA IPC (%s)", why)
        return "legacy"
    return "vmm"


class VmmHostArena(HostArena):
    backend = "cuda"
    handle_kind = "vmm"

    def __init__(self, nbytes: int, device: int) -> None:
        import torch

        from kvpool import cuda, vmm

        cuda.set_device(device)
        self.nbytes = vmm.round_up(nbytes, device)
        self.alloc = vmm.create(self.nbytes, device)
        try:
            self.fd = vmm.export_fd(self.alloc)
        except BaseException:
            vmm.release(self.alloc)
            raise
        os.set_inheritable(self.fd, False)
        self.handle = f"vmm:{device}"
        self.ptr = 0  # mapped in the pool only for its own copies (the host tier's), see :meth:`mapped`
        try:
            ptr = vmm.import_map(os.dup(self.fd), self.nbytes, device)
            try:
                cuda.zero(ptr, self.nbytes)
            finally:
                vmm.unmap(ptr, self.nbytes)
        except BaseException:
            self.close()
            raise
        props = torch.cuda.get_device_properties(device)
        self.device = DeviceInfo(index=device, uuid=str(props.uuid), name=props.name)

    def mapped(self) -> int:
        """The arena's address in the pool itself, mapped on first use: only a pool that copies blocks (to and
        from its host tier) needs one."""
        from kvpool import vmm

        if not self.ptr:
            assert self.fd is not None and self.device is not None
            self.ptr = vmm.import_map(os.dup(self.fd), self.nbytes, self.device.index)
        return self.ptr

    def close(self) -> None:
        from kvpool import vmm

        if self.ptr:
            vmm.unmap(self.ptr, self.nbytes)
            self.ptr = 0
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.alloc:
            vmm.release(self.alloc)
            self.alloc = 0
