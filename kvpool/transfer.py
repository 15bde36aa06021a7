"""Moving blocks between two arenas (two GPUs of one node) by block ids (:meth:`kvpool.client.PoolClient.move`).

The copy runs in the worker that needs the KV, on its current CUDA streams, not in the pool: that orders it
before the worker's own kernels that read the copied blocks, and keeps the pool out of the data path. Both
arenas are mapped in the worker (the source through peer access), so the bytes move GPU to GPU over the
node's links: one kernel on the destination GPU reads every layer's span of each block over the link and writes
it in place (:mod:`kvpool.blockcopy`); without Triton, and between CPU arenas, one gather, one copy and one
scatter for every layer at once (see :meth:`Arena.blocks_view`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool import blockcopy
from kvpool.arena import Arena
from kvpool.errors import InvalidRequest


def copy_blocks(src: Arena, src_ids: Sequence[int], dst: Arena, dst_ids: Sequence[int]) -> torch.Tensor | None:
    """Copy blocks ``src_ids`` of ``src`` into blocks ``dst_ids`` of ``dst``, stream-ordered.

    Returns an event (CUDA) recorded once the source blocks have been read: wait on it before the source
    blocks may be reused. The writes into ``dst`` are ordered on ``dst``'s current stream, ahead of whatever
    the caller launches there next. On the CPU the copy is done when this returns and the result is None.
    """
    if len(src_ids) != len(dst_ids):
        raise InvalidRequest(f"copy of {len(src_ids)} blocks into {len(dst_ids)}: give one target per block")
    if src.layout != dst.layout:
        raise InvalidRequest(f"arenas of different layouts: {src.layout.diff(dst.layout)}")
    if not src_ids:
        return None
    src_all, dim = src.blocks_view()
    dst_all, _ = dst.blocks_view()
    src_local, dst_local = src.local_index(src_ids), dst.local_index(dst_ids)
    if src_all.is_cuda and dst_all.is_cuda and src_all.device != dst_all.device:
        ready = torch.cuda.Event()  # the copy runs on dst's stream: after what src's has queued
        ready.record(torch.cuda.current_stream(src_all.device))
        torch.cuda.current_stream(dst_all.device).wait_event(ready)
    blockcopy.move(src_all, src_local, dst_all, dst_local, dim)
    if dst_all.device.type != "cuda":
        return None
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(dst_all.device))
    return done
