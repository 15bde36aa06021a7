"""The KV arena: one allocation for every block, created by the pool and mapped by each worker once.

Two backends behind one descriptor:

* ``cuda``: one ``cudaMalloc`` of the whole arena and its one 64-byte IPC handle. A worker opens the handle
  once (``cudaIpcOpenMemHandle``) and wraps the pointer as a torch tensor without a copy.
* ``cpu``: a file in ``/dev/shm`` created with owner-only permissions and mapped ``MAP_SHARED`` by name, so any
  process of the same user sees the same bytes. It is how kvpool runs (and is tested) without a GPU.

The pool never maps the arena itself: it only hands out block ids. Workers get per-layer K and V views shaped
``[num_blocks, block_size, num_kv_heads, head_dim]``, cut from the raw bytes by :class:`KVLayout`.
"""

from __future__ import annotations

import _thread
import base64
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvpool.errors import ArenaClosed, InvalidRequest
from kvpool.ids import BLOCK_MASK, arena_ids, arena_index, pack_ids
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger(__name__)


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


class Arena:
    """A worker's mapping of the arena: the raw bytes and per-layer K/V views, all on the same memory."""

    def __init__(self, descriptor: ArenaDescriptor, raw: torch.Tensor) -> None:
        self.descriptor = descriptor
        self.layout = descriptor.layout
        self.num_blocks = descriptor.num_blocks
        self.first_block = descriptor.first_block
        self.epoch = descriptor.epoch
        self._raw: torch.Tensor | None = raw
        used = descriptor.num_blocks * descriptor.block_nbytes
        typed = raw[:used].view(torch_dtype(self.layout.dtype))
        self._views = _layer_views(typed, self.layout, self.num_blocks)
        self._blocks: tuple[torch.Tensor, int] | None = None

    @property
    def closed(self) -> bool:
        return self._raw is None

    def _check(self) -> None:
        if self._raw is None:
            raise ArenaClosed(
                f"the arena of pool epoch {self.epoch} is closed (client closed, or the pool restarted): "
                "reconnect and call arena() again"
            )

    @property
    def raw(self) -> torch.Tensor:
        """The whole arena as uint8."""
        self._check()
        assert self._raw is not None
        return self._raw

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def k(self, layer: int) -> torch.Tensor:
        self._check()
        return self._views[layer][0]

    def v(self, layer: int) -> torch.Tensor:
        self._check()
        return self._views[layer][1]

    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) of every layer, in the NHD shape paged-attention kernels take."""
        self._check()
        return list(self._views)

    def local_ids(self, block_ids: Sequence[int]) -> list[int]:
        """Pool block ids as indices into this arena's views (they differ only on a multi-device pool)."""
        return arena_ids(block_ids, self.first_block, self.num_blocks)

    def local_index(self, block_ids: Sequence[int] | Any) -> np.ndarray:
        """:meth:`local_ids` as one int64 array (copies of many blocks)."""
        return arena_index(block_ids, self.first_block, self.num_blocks)

    def block_table(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The int32 block table of a sequence, on the arena's device, for a paged-attention kernel.

        Pool ids (fenced: a :class:`kvpool.client.Claim`'s ``ids``, an ``array('q')``, an int64 numpy array) are
        taken packed, their generations masked off in one tensor operation. On CUDA the table is copied from
        pinned memory without waiting: the copy is enqueued on the current stream, so a kernel launched after it
        there reads the table; synchronize before reading it on another stream or from the host.
        """
        import torch

        packed = pack_ids(block_ids)
        if packed is None:
            raise IndexError(f"block ids outside int64: {list(block_ids)[:8]}")
        if not len(packed):
            return torch.empty(0, dtype=torch.int32, device=self.device)
        given = torch.frombuffer(packed, dtype=torch.int64)
        host = (given & BLOCK_MASK) - self.first_block  # a new tensor: never aliases the caller's buffer
        if int(given.min()) < 0 or int(host.min()) < 0 or int(host.max()) >= self.num_blocks:
            first = self.first_block
            raise IndexError(
                f"blocks outside this arena's ids [{first}, {first + self.num_blocks}): {given.tolist()[:8]}"
            )
        host = host.to(torch.int32)
        device = self.device
        if device.type == "cuda":
            return host.pin_memory().to(device, non_blocking=True)
        return host

    def blocks_view(self) -> tuple[torch.Tensor, int]:
        """The whole arena as one 3-D tensor and the dim that indexes blocks, for copying blocks in bulk.

        layer_major: ``[2 * num_layers, num_blocks, block elems]``, blocks on dim 1; kv_packed: ``[num_layers,
        num_blocks, 2 * block elems]``, blocks on dim 1; block_major: ``[num_blocks, 2 * num_layers, block
        elems]``, blocks on dim 0. Either way one gather moves every layer's K and V of a set of blocks.
        """
        self._check()
        if self._blocks is None:  # cut once: a copy of a request's blocks should not pay for three views
            lay, e = self.layout, self.layout.block_layer_elems
            typed = self.raw[: self.num_blocks * lay.block_nbytes].view(torch_dtype(lay.dtype))
            if lay.order == "layer_major":
                self._blocks = typed.view(2 * lay.num_layers, self.num_blocks, e), 1
            elif lay.order == "kv_packed":
                self._blocks = typed.view(lay.num_layers, self.num_blocks, 2 * e), 1
            else:
                self._blocks = typed.view(self.num_blocks, 2 * lay.num_layers, e), 0
        return self._blocks

    def block(self, block_id: int) -> list[torch.Tensor]:
        """Views of one block's bytes: one tensor in block-major order, two per layer in layer-major."""
        self._check()
        (local,) = self.local_ids([block_id])
        return [t[local] for pair in self._views for t in pair]

    def invalidate(self) -> None:
        """Forbid further use through this object; the mapping stays until the process exits."""
        self._raw = None
        self._views = []
        self._blocks = None


def _layer_views(typed: torch.Tensor, layout: KVLayout, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (K, V) views. Their offsets step evenly from layer to layer and from K to V, so all of them are
    the slices of one strided tensor: one call where a view per call took most of a millisecond at 32 layers."""
    n = layout.num_layers
    start, shape, strides = layout.view_geometry(num_blocks, 0, 0)
    kv_step = layout.view_geometry(num_blocks, 0, 1)[0] - start
    layer_step = layout.view_geometry(num_blocks, min(1, n - 1), 0)[0] - start
    assert layout.view_geometry(num_blocks, n - 1, 1) == (start + (n - 1) * layer_step + kv_step, shape, strides)
    views = typed.as_strided((n, 2, *shape), (layer_step, kv_step, *strides), start)
    return [(k, v) for k, v in (layer.unbind(0) for layer in views.unbind(0))]


_mapped: dict[tuple[str, str], Arena] = {}
_map_lock = threading.Lock()


#: gets a VMM arena's file descriptor from the pool, for the device as the pool names it (None: the first)
FdSource = Callable[[int | None], int]


class FetchedFd:
    """An :data:`FdSource` that hands out an fd fetched already (with the descriptor) for ``device``, once, and
    fetches any other; :meth:`close` closes it if the mapping never took it (this process had mapped the arena)."""

    def __init__(self, fd: int | None, device: int | None, fetch: FdSource) -> None:
        self.fd, self.device, self.fetch = fd, device, fetch

    def __call__(self, device: int | None) -> int:
        if device != self.device or self.fd is None:
            return self.fetch(device)
        fd, self.fd = self.fd, None
        return fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def open_arena(
    descriptor: ArenaDescriptor,
    layout: KVLayout | None = None,
    device: int | None = None,
    fd_source: FdSource | None = None,
) -> Arena:
    """Map the arena the descriptor names, once per process; later calls return the same :class:`Arena`.

    ``device`` picks one arena of a multi-device pool (as the pool names the device); None takes the first.
    ``fd_source`` fetches the fd of a VMM arena (:meth:`kvpool.client.PoolClient.arena` passes its own).
    """
    try:
        descriptor = descriptor.part(device)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    descriptor.layout.require(layout)
    key = (descriptor.epoch, descriptor.handle)
    with _map_lock:
        arena = _mapped.get(key)
        if arena is None or arena.closed:
            arena = _map(descriptor, device, fd_source)
            _mapped[key] = arena
        return arena


def _map(descriptor: ArenaDescriptor, device: int | None, fd_source: FdSource | None) -> Arena:
    import torch

    if descriptor.backend == "cpu":
        path = descriptor.handle
        if not os.path.exists(path):
            raise ArenaClosed(f"arena file {path} is gone: the pool stopped or restarted")
        raw = torch.from_file(path, shared=True, size=descriptor.nbytes, dtype=torch.uint8)
        return Arena(descriptor, raw)

    from kvpool import cuda

    assert descriptor.device is not None
    if descriptor.handle_kind == "vmm":
        if fd_source is None:
            raise InvalidRequest(
                "this pool's arena is a VMM allocation, handed as a file descriptor over its Unix socket to a live "
                "session: map it with PoolClient.arena()"
            )
        from kvpool import vmm

        index = vmm.ordinal_of(descriptor.device.uuid)
        return _map_vmm(descriptor, cuda.ordinal_of(descriptor.device.uuid) if index is None else index, device,
                        fd_source)  # fmt: skip
    index = cuda.ordinal_of(descriptor.device.uuid)
    if descriptor.owner_pid == os.getpid():
        raise InvalidRequest(
            f"this process has the pool's PID ({os.getpid()}): either it is the pool itself (map the arena from a "
            "worker), or it runs in another PID namespace where CUDA IPC fails: share the pool's PID namespace "
            "(docker compose: pid: service:kvpool)"
        )
    with torch.cuda.device(index):
        ptr = cuda.ipc_open(base64.b64decode(descriptor.handle))
        raw = torch.as_tensor(cuda.DeviceBuffer(ptr, descriptor.nbytes), device=f"cuda:{index}")
    return Arena(descriptor, raw)


def prepare_vmm() -> None:
    """What mapping a VMM arena needs before its fd is here: the thread that will cut the views, kvpool's driver
    modules, libcuda and ``cuInit``. Run while the pool answers for the fd, it is off the attach's path. Best
    effort: an error shows again, in full, when the mapping runs into it."""
    global _spare
    with _spare_lock:
        if _spare is None:
            _spare = Beside()
    from kvpool import cuda, vmm

    with contextlib.suppress(cuda.CudaError):
        vmm.driver()


def _map_vmm(descriptor: ArenaDescriptor, index: int, device: int | None, fd_source: FdSource) -> Arena:
    import torch

    from kvpool import cuda, vmm

    global _spare

    def wrap(ptr: int) -> Arena:
        with torch.cuda.device(index):
            return Arena(descriptor, torch.as_tensor(cuda.DeviceBuffer(ptr, descriptor.nbytes), device=f"cuda:{index}"))

    with _spare_lock:
        views, _spare = _spare or Beside(), None
    with torch.cuda.device(index):
        vmm.use_device(index)
        access = vmm.peers(index)
        try:  # the views are cut while the driver grants access (milliseconds at 64 GiB)
            ptr = vmm.import_map(fd_source(device), descriptor.nbytes, index, access, lambda p: views.start(wrap, p))
        except BaseException:
            views.cancel()
            raise
        try:
            arena = views.result()
        except BaseException:
            vmm.unmap(ptr, descriptor.nbytes)
            raise
    log.debug("mapped VMM arena of %d bytes on cuda:%d at %#x", descriptor.nbytes, index, ptr)
    return arena


class Beside:
    """One piece of work for a thread of its own, given by :meth:`start` right before a long driver call that lets
    the GIL go: the work runs in that wait instead of after it.

    The thread starts at once and waits, through ``_thread``: ``threading.Thread.start`` would block until the new
    thread runs, a third of a millisecond on a serving host, where this start overlaps what its caller does next.
    """

    def __init__(self) -> None:
        self._go = threading.Event()
        self._done = threading.Event()
        self._work: Callable[[int], Arena] | None = None
        self._arg = 0
        self._out: Arena | BaseException | None = None
        _thread.start_new_thread(self._run, ())

    def _run(self) -> None:
        self._go.wait()
        try:
            if self._work is not None:
                self._out = self._work(self._arg)
        except BaseException as exc:  # handed to result(), on the caller's thread
            self._out = exc
        finally:
            self._done.set()

    def start(self, work: Callable[[int], Arena], arg: int) -> None:
        self._work, self._arg = work, arg
        self._go.set()

    def cancel(self) -> None:
        """Let the thread end without work (the mapping failed before the grant), or wait for work already given."""
        self._go.set()
        self._done.wait()

    def result(self) -> Arena:
        self._done.wait()
        out = self._out
        if isinstance(out, BaseException):
            raise out
        assert out is not None, "no work was given"
        return out


_spare: Beside | None = None
_spare_lock = threading.Lock()


def _drop_spare() -> None:
    global _spare
    _spare = None  # its thread stayed in the parent: a fork's mapping waiting on it would wait forever


os.register_at_fork(after_in_child=_drop_spare)


def forget_mappings(epoch: str | None = None) -> None:
    """Invalidate the mapped arenas of pool epoch ``epoch`` (used when that pool restarted), or all of them.

    Scoped to one epoch so that a process talking to two pools does not lose the other pool's views when one
    restarts: epochs are random per pool start, so an epoch names exactly one pool's arenas.
    """
    with _map_lock:
        for key in [k for k in _mapped if epoch is None or k[0] == epoch]:
            _mapped.pop(key).invalidate()
