"""The shared-memory directory (``--shm-dir``): checked before the pool listens, so that a pool that cannot put its
files there says so in one line instead of starting, logging that it listens, and stopping.

The CPU arena, the host tier and the slab table are files there, mapped by every worker: they must be in memory
(a tmpfs such as ``/dev/shm``), or the KV would live in a file on disk. A mistyped directory is refused rather
than created, and an arena or host tier larger than the room left there is refused naming its setting.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvpool.errors import InvalidRequest
from kvpool.server.arenas import resolve_backend, size_in_blocks
from kvpool.server.config import PoolSettings
from kvpool.server.tiers.tiermemory import host_tier_blocks

#: filesystems whose files are memory
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def filesystem_of(path: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """The type of the filesystem ``path`` is on (the longest mount point above it), None where Linux says nothing."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    real, best, kind = os.path.realpath(path), "", None
    for line in lines:
        fields = line.split()
        point = fields[4].encode().decode("unicode_escape")  # spaces in mount points are written \040
        fstype = fields[fields.index("-") + 1]
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind


def shm_problem(settings: PoolSettings) -> str | None:
    """Why the pool cannot keep its shared-memory files in ``--shm-dir``, with what to change; None if it can."""
    s = settings
    try:
        cpu = resolve_backend(s.backend) == "cpu"
        host = host_tier_blocks(s.layout, s.host_blocks, s.host_bytes) * s.layout.block_nbytes
        blocks = size_in_blocks(s.layout, num_blocks=s.num_blocks, arena_bytes=s.arena_bytes,
                                gpu_memory_fraction=None, free_device_bytes=None) if cpu else 0  # fmt: skip
    except InvalidRequest as exc:
        return str(exc)
    arena = blocks * s.layout.block_nbytes * len(s.device_list)
    if not (cpu or host or s.slabs):
        return None
    d = s.shm_dir
    if not d.is_dir():
        return (
            f"--shm-dir {d} (KVPOOL_SHM_DIR) is not a directory: give an existing tmpfs directory such as /dev/shm "
            "(the pool does not create it, so that a mistyped one cannot put the KV in a file on disk)"
        )
    kind = filesystem_of(d)
    if kind is not None and kind not in MEMORY_FILESYSTEMS:
        return (
            f"--shm-dir {d} (KVPOOL_SHM_DIR) is on {kind}, not tmpfs: the KV would be a file on disk; give a tmpfs "
            "directory such as /dev/shm"
        )
    st = os.statvfs(d)
    room = st.f_bavail * st.f_frsize
    if arena > room:
        return (
            f"the CPU arena needs {gib(arena)} and --shm-dir {d} has {gib(room)} free: make the arena smaller "
            "(--num-blocks, --arena-bytes) or the directory larger (docker: shm_size)"
        )
    if arena + host > room:
        return (
            f"the host tier needs {gib(host)} and --shm-dir {d} has {gib(room - arena)} free after the arena: make the "
            "host tier smaller (--host-blocks, --host-bytes) or the directory larger (docker: shm_size)"
        )
    return None
