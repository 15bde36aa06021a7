"""The pool's side of the arena: it owns the one allocation and describes it, and never builds views.

Workers map what the descriptor names through :mod:`kvpool.arena`; the pool only creates, exports and removes it.
"""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path
from typing import Literal

from kvpool.errors import InvalidRequest
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor, ArenaPart, DeviceInfo, HandleKind
from kvpool.server.config import DEFAULT_NUM_BLOCKS

log = logging.getLogger(__name__)

CUDA_ALIGN = 2 << 20
SHM_PREFIX = "kvpool-"
ArenaHandle = Literal["auto", "vmm", "legacy"]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def resolve_backend(backend: str) -> Literal["cuda", "cpu"]:
    if backend == "auto":
        return "cuda" if cuda_available() else "cpu"
    if backend == "cuda" and not cuda_available():
        raise InvalidRequest("backend 'cuda' was asked for but torch sees no CUDA device: use --backend cpu")
    return "cuda" if backend == "cuda" else "cpu"


def size_in_blocks(
    layout: KVLayout,
    *,
    num_blocks: int | None,
    arena_bytes: int | None,
    gpu_memory_fraction: float | None,
    free_device_bytes: int | None,
    default_blocks: int = DEFAULT_NUM_BLOCKS,
) -> int:
    """How many blocks the arena gets, from exactly one of: blocks, bytes, a share of free GPU memory."""
    if num_blocks is not None:
        n = num_blocks
    elif arena_bytes is not None:
        n = arena_bytes // layout.block_nbytes
    elif gpu_memory_fraction is not None:
        if free_device_bytes is None:
            raise InvalidRequest("gpu_memory_fraction needs the cuda backend: size the cpu arena in blocks or bytes")
        n = int(free_device_bytes * gpu_memory_fraction) // layout.block_nbytes
    else:
        n = default_blocks
    if n < 1:
        raise InvalidRequest(f"the arena must hold at least one block of {layout.block_nbytes} bytes")
    return n


class OwnedArena:
    """The pool's side of the arena: owns the allocation and describes it; never builds views."""

    backend: Literal["cuda", "cpu"]
    handle_kind: HandleKind
    handle: str
    nbytes: int
    device: DeviceInfo | None = None
    #: the exported file descriptor of a VMM arena, handed to authenticated sessions over the fast channel
    fd: int | None = None

    def close(self) -> None:
        raise NotImplementedError


class CpuOwnedArena(OwnedArena):
    backend = "cpu"
    handle_kind = "shm"

    def __init__(self, nbytes: int, shm_dir: Path, epoch: str, what: str = "the arena") -> None:
        shm_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_arenas(shm_dir)
        self.path = shm_dir / f"{SHM_PREFIX}{os.getpid()}-{epoch}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise InvalidRequest(
                    f"cannot reserve {nbytes} bytes in {shm_dir} ({exc.strerror}): make {what} smaller or "
                    f"{shm_dir} larger (docker: shm_size)"
                ) from None
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.handle = str(self.path)
        self.nbytes = nbytes

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def remove_stale_arenas(shm_dir: Path) -> None:
    """Delete arena files left by pools that died without cleaning up (their pid is gone)."""
    for path in shm_dir.glob(f"{SHM_PREFIX}*-*"):
        try:
            pid = int(path.name[len(SHM_PREFIX) :].split("-", 1)[0])
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except (ValueError, OSError) as exc:
            if isinstance(exc, ProcessLookupError):
                log.info("removing stale arena %s of dead pool %s", path, pid)
                path.unlink(missing_ok=True)


class CudaOwnedArena(OwnedArena):
    backend = "cuda"
    handle_kind = "cuda_ipc"

    def __init__(self, nbytes: int, device: int) -> None:
        import torch

        from kvpool import cuda

        cuda.set_device(device)
        self.nbytes = (nbytes + CUDA_ALIGN - 1) // CUDA_ALIGN * CUDA_ALIGN
        self.ptr = cuda.malloc(self.nbytes)
        cuda.zero(self.ptr, self.nbytes)
        self.handle = base64.b64encode(cuda.ipc_get_handle(self.ptr)).decode()
        props = torch.cuda.get_device_properties(device)
        self.device = DeviceInfo(index=device, uuid=str(props.uuid), name=props.name)

    def mapped(self) -> int:
        """The arena's address in the pool, for the pool's own copies (the host tier's)."""
        return self.ptr

    def close(self) -> None:
        from kvpool import cuda

        if self.ptr:
            cuda.free(self.ptr)
            self.ptr = 0


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


class VmmOwnedArena(OwnedArena):
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
            # every peer GPU may read it: a copy of blocks between two arenas runs on the destination's GPU
            self.ptr = vmm.import_map(os.dup(self.fd), self.nbytes, self.device.index, vmm.peers(self.device.index))
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


def create_owned_arena(
    backend: Literal["cuda", "cpu"], nbytes: int, *, device: int, shm_dir: Path, epoch: str,
    arena_handle: ArenaHandle = "legacy", fd_passing: bool = False,
) -> OwnedArena:  # fmt: skip
    if backend == "cuda":
        if resolve_handle(arena_handle, device, fd_passing) == "vmm":
            return VmmOwnedArena(nbytes, device)
        return CudaOwnedArena(nbytes, device)
    return CpuOwnedArena(nbytes, shm_dir, epoch)


def create_arenas(
    backend: Literal["cuda", "cpu"],
    devices: list[int],
    layout: KVLayout,
    epoch: str,
    *,
    num_blocks: int | None,
    arena_bytes: int | None,
    gpu_memory_fraction: float | None,
    shm_dir: Path,
    arena_handle: ArenaHandle = "legacy",
    fd_passing: bool = False,
) -> tuple[list[OwnedArena], list[int]]:
    """One arena per device, each sized one way, and their sizes in blocks; on a failure none is left behind."""
    arenas: list[OwnedArena] = []
    sizes: list[int] = []
    try:
        for d in devices:
            free_bytes = None
            if backend == "cuda":
                from kvpool import cuda

                cuda.set_device(d)
                free_bytes = cuda.mem_get_info()[0]
            n = size_in_blocks(
                layout,
                num_blocks=num_blocks,
                arena_bytes=arena_bytes,
                gpu_memory_fraction=gpu_memory_fraction,
                free_device_bytes=free_bytes,
            )
            part_epoch = epoch if len(devices) == 1 else f"{epoch}-{d}"
            nbytes = n * layout.block_nbytes
            arenas.append(create_owned_arena(backend, nbytes, device=d, shm_dir=shm_dir, epoch=part_epoch,
                                            arena_handle=arena_handle, fd_passing=fd_passing))  # fmt: skip
            sizes.append(n)
    except BaseException:
        for arena in arenas:
            arena.close()
        raise
    return arenas, sizes


def describe(
    epoch: str,
    devices: list[int],
    arenas: list[OwnedArena],
    sizes: list[int],
    layout: KVLayout,
    model: str,
    fast_socket: str | None,
) -> ArenaDescriptor:
    """The descriptor clients map the arenas by: the first arena's fields at the top, every arena in ``arenas``."""
    parts, first = [], 0
    for d, arena, n in zip(devices, arenas, sizes, strict=True):
        parts.append(ArenaPart(index=d, device=arena.device, handle=arena.handle, nbytes=arena.nbytes,
                               num_blocks=n, first_block=first, handle_kind=arena.handle_kind))  # fmt: skip
        first += n
    head = parts[0]
    return ArenaDescriptor(
        epoch=epoch,
        backend=arenas[0].backend,
        device=head.device,
        handle=head.handle,
        handle_kind=head.handle_kind,
        nbytes=head.nbytes,
        num_blocks=head.num_blocks,
        block_nbytes=layout.block_nbytes,
        layout=layout,
        owner_pid=os.getpid(),
        model=model,
        fast_socket=fast_socket,
        arenas=parts,
    )
