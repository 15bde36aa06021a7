"""The host tier's memory, and the pool's own mapping of the arenas it copies between.

The host tier is a file in /dev/shm, like the cpu backend's arena, so that any process of the pool's user can map
it by name (one mapping per process). With CUDA the pool page-locks its mapping (``cudaHostRegister``), which is
what lets copies to and from the GPU run at full speed on a side stream; a worker that copies host blocks itself
would register its own mapping the same way. The pool is the one process that copies: it maps the arena(s) it
allocated (the CUDA allocation through its own pointer, never through IPC) and the host tier, and nothing else.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.arena import Arena, torch_dtype
from kvpool.errors import InvalidRequest
from kvpool.hosttier import page_lock
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor, HostTierPart
from kvpool.server.arenas import CpuOwnedArena, CudaOwnedArena, OwnedArena, VmmOwnedArena
from kvpool.server.books.hosttier import HostTier
from kvpool.server.config import PoolSettings
from kvpool.server.tiers.tiercopy import TierCopier

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def host_tier_blocks(layout: KVLayout, host_blocks: int | None, host_bytes: int | None) -> int:
    """Blocks of the host tier from ``--host-blocks`` or ``--host-bytes``; 0 when neither is given (no tier)."""
    if host_blocks is not None:
        return host_blocks
    if host_bytes is None:
        return 0
    n = host_bytes // layout.block_nbytes
    if n < 1:
        raise InvalidRequest(
            f"--host-bytes {host_bytes} holds no block of {layout.block_nbytes} bytes: give at least one block's worth"
        )
    return n


def open_host_tier(
    settings: PoolSettings, layout: KVLayout, epoch: str, descriptor: ArenaDescriptor, arenas: list[OwnedArena]
) -> HostTierMemory | None:
    """The host tier the settings ask for (None if they ask for none)."""
    n = host_tier_blocks(layout, settings.host_blocks, settings.host_bytes)
    return HostTierMemory(n, layout, settings.shm_dir, epoch, descriptor, arenas) if n else None


class HostTierMemory:
    """The host tier's file, the pool's page-locked mapping of it, and the pool's views of the arenas."""

    def __init__(
        self, num_blocks: int, layout: KVLayout, shm_dir: Path, epoch: str, descriptor: ArenaDescriptor,
        arenas: list[OwnedArena],
    ) -> None:  # fmt: skip
        import torch

        self.file = CpuOwnedArena(
            num_blocks * layout.block_nbytes, shm_dir, f"{epoch}-host", "the host tier (--host-blocks, --host-bytes)"
        )
        self.registered = 0
        try:
            raw = torch.from_file(self.file.handle, shared=True, size=self.file.nbytes, dtype=torch.uint8)
            if any(isinstance(a, CudaOwnedArena) for a in arenas):
                page_lock(raw.data_ptr(), raw.numel(), "the host tier (--host-blocks)")
                self.registered = raw.data_ptr()
            typed = raw.view(torch_dtype(layout.dtype))
            self.host = typed.view(num_blocks, 2 * layout.num_layers, layout.block_layer_elems)
            views = [blocks_view_of(descriptor.part(part.index), arena) for part, arena in
                     zip(descriptor.arenas, arenas, strict=True)]  # fmt: skip
        except BaseException:
            self.close()
            raise
        self.tier = HostTier(num_blocks, TierCopier(views, self.host))
        self.tier.copier.warm()
        self.raw = raw
        log.info(
            "host tier ready: %d blocks (%.1f MiB) in %s%s", num_blocks, self.file.nbytes / 2**20, self.file.handle,
            ", page-locked" if self.registered else "",
        )  # fmt: skip

    def describe(self, descriptor: ArenaDescriptor) -> ArenaDescriptor:
        """The arena descriptor with the host tier in it, for workers that map the tier themselves."""
        part = HostTierPart(handle=self.file.handle, nbytes=self.file.nbytes, num_blocks=self.tier.num_blocks)
        return descriptor.model_copy(update={"host_tier": part})

    def close(self) -> None:
        if self.registered:
            import torch

            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = 0
        self.file.close()


def blocks_view_of(part: ArenaDescriptor, arena: OwnedArena) -> tuple[torch.Tensor, int]:
    """The pool's own view of an arena it owns, as :meth:`Arena.blocks_view` cuts it, for the copies it makes."""
    import torch

    if isinstance(arena, CudaOwnedArena | VmmOwnedArena):
        from kvpool import cuda

        assert arena.device is not None
        raw = torch.as_tensor(cuda.DeviceBuffer(arena.mapped(), arena.nbytes), device=f"cuda:{arena.device.index}")
    elif arena.backend == "cpu":
        raw = torch.from_file(arena.handle, shared=True, size=arena.nbytes, dtype=torch.uint8)
    else:
        raise TypeError(f"the pool cannot copy blocks of a {type(arena).__name__}")
    return Arena(part, raw).blocks_view()
