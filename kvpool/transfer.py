"""Moving blocks between two arenas (two GPUs of one node) by block ids (:meth:`kvpool.client.PoolClient.move`).

The copy runs in the worker that needs the KV, on its current CUDA streams, not in the pool: that orders it
before the worker's own kernels that read the copied blocks, and keeps the pool out of the data path. Both
arenas are mapped in the worker (the source through peer access), so the bytes move GPU to GPU over the
node's links. Between two CUDA arenas (two GPUs, or two arenas of one GPU) the copy is one batch of byte ranges,
every layer's K and V of every block, handed to the copy engines in one driver call (:mod:`kvpool.batchcopy`).
Where the driver has no batch copy, and between CPU arenas, it is one gather on the source, one copy of the
gathered blocks and one scatter on the destination, for every layer at once (see :meth:`Arena.blocks_view`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool import batchcopy
from kvpool.arena import Arena
from kvpool.errors import InvalidRequest


def copy_blocks(src: Arena, src_ids: Sequence[int], dst: Arena, dst_ids: Sequence[int]) -> torch.cuda.Event | None:
    """Copy blocks ``src_ids`` of ``src`` into blocks ``dst_ids`` of ``dst``, stream-ordered.

    Returns an event (CUDA) recorded once the source blocks have been read: wait on it before the source
    blocks may be reused. The writes into ``dst`` are ordered on ``dst``'s current stream, ahead of whatever
    the caller launches there next. On the CPU the copy is done when this returns and the result is None.

    Between CUDA arenas the copy is one batch of byte ranges for the copy engines (:mod:`kvpool.batchcopy`),
    queued on ``dst``'s current stream after the work queued on ``src``'s; where that stream is the legacy default
    one, which the driver refuses for batches, on a stream beside it that it then waits for.
    """
    if len(src_ids) != len(dst_ids):
        raise InvalidRequest(f"copy of {len(src_ids)} blocks into {len(dst_ids)}: give one target per block")
    if src.layout != dst.layout:
        raise InvalidRequest(f"arenas of different layouts: {src.layout.diff(dst.layout)}")
    if not src_ids:
        return None
    src_all, dim = src.blocks_view()
    dst_all, _ = dst.blocks_view()
    src_local, dst_local = src.local_ids(src_ids), dst.local_ids(dst_ids)
    if src_all.is_cuda and dst_all.is_cuda:
        done = _batch(src_all, src_local, dst_all, dst_local, dim)
        if done is not None:
            return done
    src_idx = torch.tensor(src_local, device=src_all.device)
    dst_idx = torch.tensor(dst_local, device=dst_all.device)
    staged = src_all.index_select(dim, src_idx)
    if staged.device != dst_all.device:
        staged = staged.to(dst_all.device, non_blocking=True)
    done = None
    if dst_all.device.type == "cuda":
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(dst_all.device))
    dst_all.index_copy_(dim, dst_idx, staged)
    return done


def _batch(
    src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int], dim: int
) -> torch.cuda.Event | None:
    """The copy as one batch, after the work queued on both devices' current streams and ahead of what comes next
    on ``dst``'s; the event recorded after it, or None where the caller must gather, copy and scatter instead (on
    ``dst``'s current stream, after anything a failed call queued)."""
    if not batchcopy.available():
        return None
    src_stream, dst_stream = torch.cuda.current_stream(src.device), torch.cuda.current_stream(dst.device)
    with torch.cuda.device(dst.device):
        if dst_stream.cuda_stream:  # the caller's own stream: the copy goes on it
            stream = dst_stream
        else:  # the legacy default stream (torch's default), which the driver refuses: a stream beside it
            stream = batchcopy.side_stream(dst.device)
            stream.wait_stream(dst_stream)
        if src_stream != dst_stream:
            stream.wait_stream(src_stream)
        if not batchcopy.copy(src, src_ids, dst, dst_ids, dim, stream):
            if stream is not dst_stream:
                dst_stream.wait_stream(stream)  # a call that failed part way may have queued ranges there
            return None
        done = torch.cuda.Event()
        done.record(stream)
        if stream is not dst_stream:
            dst_stream.wait_event(done)
    return done
