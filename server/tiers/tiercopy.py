"""The copies between the GPU arena and the host tier, made by the pool process, which maps both.

The host tier stores each block as one contiguous run of bytes (``[num_blocks, 2 * num_layers, block elems]``),
whatever the arena's order, so that a batch of host blocks with neighbouring ids is one large copy over PCIe: a
batch is sorted by host id and cut into runs of consecutive ids, each run is one copy between the host tier and a
staging buffer on the arena's device, and one gather (offload) or scatter (restore) on the device moves every
layer's K and V between the staging buffer and the arena's blocks. On CUDA the copies run on a side stream of their
own and the call returns once that stream is done, so a block handed out afterwards is never read or written by a
copy still in flight. Without CUDA the same code runs on CPU tensors (the arena and the host tier are both files in
/dev/shm), so CI runs the logic the GPU runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: the staging buffer on the arena's device: large enough that each copy is long, small beside the arena
STAGING_BYTES = 64 << 20


@dataclass
class CopyTotals:
    """Blocks and bytes moved each way and the seconds the copies took (sorting and launching included)."""

    offloaded_blocks: int = 0
    restored_blocks: int = 0
    offloaded_bytes: int = 0
    restored_bytes: int = 0
    offload_s: float = 0.0
    restore_s: float = 0.0

    def bandwidth(self, direction: str) -> float:
        """Bytes per second over every copy so far in one direction ("offload" or "restore"); 0 before any."""
        moved, took = getattr(self, f"{direction.removesuffix('e')}ed_bytes"), getattr(self, f"{direction}_s")
        return moved / took if took > 0 else 0.0


def runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first id, position in ``ids``, length) of each run of consecutive ids in the sorted ``ids``."""
    out: list[tuple[int, int, int]] = []
    for pos, block in enumerate(ids):
        if out and out[-1][0] + out[-1][2] == block:
            first, at, n = out[-1]
            out[-1] = (first, at, n + 1)
        else:
            out.append((block, pos, 1))
    return out


class TierCopier:
    """Moves blocks between the arenas (one per device) and the host tier, in batches.

    ``arenas`` holds, per arena, its blocks view and the dim that indexes blocks (:meth:`Arena.blocks_view`), with
    local block ids; ``host`` is the host tier's ``[num_blocks, 2 * num_layers, block elems]`` view.
    """

    def __init__(self, arenas: Sequence[tuple[torch.Tensor, int]], host: torch.Tensor) -> None:

        self.arenas = list(arenas)
        self.host = host
        self.block_nbytes = host[0].numel() * host.element_size()
        self.chunk = max(1, min(host.shape[0], STAGING_BYTES // self.block_nbytes))
        self.totals = CopyTotals()
        self._staging: dict[int, torch.Tensor] = {}
        self._streams: dict[int, torch.cuda.Stream] = {}

    def _device_parts(self, arena: int) -> tuple[torch.Tensor, int, torch.Tensor, torch.cuda.Stream | None]:
        import torch

        view, dim = self.arenas[arena]
        staging = self._staging.get(arena)
        if staging is None:
            # a block as the arena's view holds it (a kv_packed arena: [layers, 2 * block elems]), host blocks alike
            block = view.shape[:dim] + view.shape[dim + 1 :]
            staging = torch.empty((self.chunk, *block), dtype=self.host.dtype, device=view.device)
            self._staging[arena] = staging
            if view.is_cuda:
                self._streams[arena] = torch.cuda.Stream(device=view.device)
        return view, dim, staging, self._streams.get(arena)

    def warm(self) -> None:
        """Copy one block each way per arena and forget it: before the pool serves, while every block is free.

        The first copy pays for the stream, the staging buffer and the kernels' loading (tenths of a second on a
        GPU): a pool start, not the first request to evict or hit, should pay it. It also proves the path works.
        """
        for arena in range(len(self.arenas)):
            self.offload(arena, [0], [0])
            self.restore(arena, [0], [0])
        self.totals = CopyTotals()

    def offload(self, arena: int, device_ids: Sequence[int], host_ids: Sequence[int]) -> None:
        """Copy the arena's blocks ``device_ids`` into the host tier's blocks ``host_ids`` (pairwise)."""
        self._copy(arena, device_ids, host_ids, to_host=True)

    def restore(self, arena: int, host_ids: Sequence[int], device_ids: Sequence[int]) -> None:
        """Copy the host tier's blocks ``host_ids`` into the arena's blocks ``device_ids`` (pairwise)."""
        self._copy(arena, device_ids, host_ids, to_host=False)

    def _copy(self, arena: int, device_ids: Sequence[int], host_ids: Sequence[int], *, to_host: bool) -> None:
        import torch

        if len(device_ids) != len(host_ids):
            raise ValueError(f"{len(device_ids)} arena blocks against {len(host_ids)} host blocks")
        if not device_ids:
            return
        start = time.perf_counter()
        view, dim, staging, stream = self._device_parts(arena)
        pairs = sorted(zip(host_ids, device_ids, strict=True))
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            for lo in range(0, len(pairs), self.chunk):
                part = pairs[lo : lo + self.chunk]
                n = len(part)
                index = torch.tensor([d for _, d in part], dtype=torch.long).to(view.device, non_blocking=True)
                stage = staging[:n]
                if to_host:
                    gathered = view.index_select(dim, index)
                    stage.copy_(gathered if dim == 0 else gathered.transpose(0, 1))
                host = self.host.view(self.host.shape[0], *stage.shape[1:])
                for first, at, length in runs([h for h, _ in part]):
                    host_part, stage_part = host[first : first + length], stage[at : at + length]
                    if to_host:
                        host_part.copy_(stage_part, non_blocking=True)
                    else:
                        stage_part.copy_(host_part, non_blocking=True)
                if not to_host:
                    view.index_copy_(dim, index, stage if dim == 0 else stage.transpose(0, 1))
        if stream is not None:
            stream.synchronize()
        took = time.perf_counter() - start
        t, nbytes = self.totals, len(pairs) * self.block_nbytes
        if to_host:
            t.offloaded_blocks += len(pairs)
            t.offloaded_bytes += nbytes
            t.offload_s += took
        else:
            t.restored_blocks += len(pairs)
            t.restored_bytes += nbytes
            t.restore_s += took


class ArenaCopier:
    """Copies blocks from one arena into another (one per GPU of the pool), for a lookup that another GPU's arena
    serves further (:mod:`kvpool.server.books.peers`): on GPUs one kernel on the destination's GPU reads each block's
    spans over the link and writes them in place (:mod:`kvpool.blockcopy`); elsewhere (CPU arenas, no Triton) one
    gather, one copy to the destination's device, one scatter. The call returns once the copy is done.

    ``arenas`` holds, per arena, its blocks view and the dim that indexes blocks (:meth:`Arena.blocks_view`)."""

    def __init__(self, arenas: Sequence[tuple[torch.Tensor, int]]) -> None:
        self.arenas = list(arenas)

    def warm(self) -> None:
        """Copy block 0 of the first arena into the second's and back, before the pool serves (every block is
        free): the kernel's build (a second or so) belongs to the pool's start, not to the first lookup."""
        if len(self.arenas) > 1:
            self.copy(0, [0], 1, [0])
            self.copy(1, [0], 0, [0])

    def copy(self, src_arena: int, src_ids: Sequence[int], dst_arena: int, dst_ids: Sequence[int]) -> None:
        import torch

        from kvpool import blockcopy

        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks against {len(dst_ids)} destination blocks")
        src, dim = self.arenas[src_arena]
        dst, _ = self.arenas[dst_arena]
        blockcopy.move(src, src_ids, dst, dst_ids, dim)
        if dst.is_cuda:
            torch.cuda.synchronize(dst.device)
