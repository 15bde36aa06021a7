"""A worker's mapping of the pool's host tier (``kvpool serve --host-blocks``), once per process.

The pool copies blocks between its arena and the host tier itself; a worker maps the tier only to read or write host
blocks on its own (say, to stage KV it sends elsewhere). The tier is a shared-memory file, mapped shared; with CUDA
the mapping is page-locked (``cudaHostRegister``), once per process as the pool does, so copies run at full speed.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from kvpool.arena import torch_dtype
from kvpool.errors import ArenaClosed, InvalidRequest
from kvpool.protocol import ArenaDescriptor

if TYPE_CHECKING:
    import torch

_mapped: dict[tuple[str, str], torch.Tensor] = {}
_lock = threading.Lock()


def open_host_tier(descriptor: ArenaDescriptor, pin: bool = True) -> torch.Tensor:
    """The host tier as ``[num_blocks, 2 * num_layers, block elems]`` in the KV dtype (K then V of each layer).

    ``pin`` page-locks the mapping when torch sees a GPU. Host block ``i`` is row ``i``; which blocks hold which
    prefix is the pool's to know: read a block only while the pool cannot reuse it.
    """
    import torch

    tier = descriptor.host_tier
    if tier is None:
        raise InvalidRequest("this pool has no host tier: start it with --host-blocks or --host-bytes")
    key = (descriptor.epoch, tier.handle)
    with _lock:
        view = _mapped.get(key)
        if view is not None:
            return view
        if not os.path.exists(tier.handle):
            raise ArenaClosed(f"host tier file {tier.handle} is gone: the pool stopped or restarted")
        raw = torch.from_file(tier.handle, shared=True, size=tier.nbytes, dtype=torch.uint8)
        if pin and torch.cuda.is_available():
            page_lock(raw.data_ptr(), raw.numel(), "the host tier")
        lay = descriptor.layout
        view = raw.view(torch_dtype(lay.dtype)).view(tier.num_blocks, 2 * lay.num_layers, lay.block_layer_elems)
        _mapped[key] = view
        return view


def page_lock(ptr: int, nbytes: int, what: str) -> None:
    """``cudaHostRegister`` a mapping (portable: every device sees it as pinned), or say why it cannot be.

    A refused registration leaves its error as the thread's last CUDA error, which torch would report at its next
    kernel launch as that kernel's: it is cleared here, so that only this call fails.
    """
    import torch

    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
    if err:
        from kvpool import cuda

        cuda.cudart().cudaGetLastError()
        raise InvalidRequest(
            f"cannot page-lock {what}'s {nbytes} bytes (cudaError {err}): put it on a tmpfs such as /dev/shm "
            "(--shm-dir), make it smaller, or raise the memlock limit (ulimit -l; docker: --ulimit memlock=-1)"
        )
