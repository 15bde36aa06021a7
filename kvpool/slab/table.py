"""The slab table: a shared-memory file the pool owns, one region per session that holds a reservation slab.

One file per pool epoch (``kvpool-slabs-<pid>-<epoch>`` in the pool's shm directory, mode 0600). Its first page says
what it is; then come ``regions`` regions of equal size, each page-aligned so that a session maps its own region
read-write and the whole table read-only. Every field has one writer, so nobody needs a cross-process
compare-and-swap:

* the pool writes a region's ``nonce`` (which session occupies it; 0: nobody), ``want`` (raised when the pool
  needs idle slab blocks back) and, per slot, ``settled`` (the handoff sequence whose ownership it has moved);
* the session writes ``done`` (the ``want`` it has answered), ``hseq`` (its last handoff's sequence) and its
  slots: the block a slot holds and its ``state``, and for a handed block to whom (region and nonce) and under
  which sequence;
* for handoffs between slabs with no system call on the way (:mod:`kvpool.slab.send`, :mod:`kvpool.slab.box`), the
  session also writes, as a producer, its ``ring`` of recent handoffs, one ``bell`` per consumer region (the
  sequence of its latest handoff in the ring to that region) and one ``sent`` per consumer region (the sequence of
  its latest handoff to that region that left as a datagram), and as a consumer, per producer region, ``watch``
  (the producer's nonce, once it reads that producer's ring) and ``took`` (the last sequence it took from it),
  plus ``waiting`` while it sleeps on its slab box (a producer then sends it a wake-up).

The pool trusts none of what a session writes about blocks: it acts on a slot only for a block its own books say
that session holds in its slab. A writer publishes a slot's other fields before its ``state``, and readers read
``state`` first (docs/operations.md, "Slabs", says why this is safe).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import threading
from array import array
from pathlib import Path

import numpy as np

from kvpool.errors import InvalidRequest

log = logging.getLogger("kvpool")

MAGIC = b"KVLT0003"
TABLE_PREFIX = "kvpool-slabs-"
#: magic, regions, slots per region, region bytes, epoch (16 bytes, ascii)
FILE_HEAD = struct.Struct("<8sIIQ16s")
PAGE = mmap.ALLOCATIONGRANULARITY

EMPTY, IDLE, ALLOCATED, HANDED = 0, 1, 2, 3

SLOT = np.dtype([("block", "<i8"), ("state", "<u4"), ("to_region", "<u4"), ("seq", "<u8"), ("to_nonce", "<u8")])
HEAD_BYTES = 64
NONCE, WANT, DONE, HSEQ, WAITING = 0, 1, 2, 3, 4  # the header's words; then each slot is 4: block,
# state | to_region << 32, seq, to_nonce
#: handoffs a producer's ring holds; one whose consumer has not taken it is not overwritten
RING = 32
ENTRY = 1024
#: an entry of the ring: sequence, the previous entry's to the same consumer (0: none), the last handoff to it that
#: went as a datagram instead, the consumer's nonce, num_tokens, its region, number of ids, first slot of a run
#: (-1: slots listed), request id bytes, meta bytes; then the ids (i64: the consumer asks the pool about these if
#: the slots were settled and reused meanwhile), the slots (i32, unless a run), request id, meta JSON
ENTRY_HEAD = struct.Struct("<QQQQQIIiHH")
ENTRY_ROOM = ENTRY - ENTRY_HEAD.size


_FENCE = threading.Lock()


def fence() -> None:
    """Orders this thread's earlier stores before its later loads as other processes see them: a lock's atomic
    instruction is a full barrier on x86-64, where a plain store may otherwise still sit in the core's buffer when a
    later load reads. A producer rings a bell and then reads whether its consumer sleeps; the consumer says it
    sleeps and then reads the bells: with a fence on both sides, one of them sees the other."""
    with _FENCE:
        pass


def column(typecode: str, value: int, n: int) -> memoryview:
    """``n`` copies of ``value``: one word of each slot of a run of ``n``, written or compared in one call."""
    return memoryview(array(typecode, (value,)) * n)


def region_dtype(slots: int, regions: int) -> np.dtype:
    """One region: its header (pool: nonce, want; session: done, hseq, waiting), the session's slots, the pool's
    settled, then the session's bells, sent, took and watch (one each per region) and ring."""
    settled_at = HEAD_BYTES + SLOT.itemsize * slots
    bells_at = settled_at + 8 * slots
    sent_at = bells_at + 8 * regions
    took_at = sent_at + 8 * regions
    watch_at = took_at + 8 * regions
    ring_at = watch_at + 8 * regions
    size = ring_at + RING * ENTRY
    size = (size + PAGE - 1) // PAGE * PAGE
    per_region = ("<u8", (regions,))
    fields = {
        "nonce": ("<u8", 0),
        "want": ("<u8", 8),
        "done": ("<u8", 16),
        "hseq": ("<u8", 24),
        "waiting": ("<u8", 32),
        "slots": ((SLOT, (slots,)), HEAD_BYTES),
        "settled": (("<u8", (slots,)), settled_at),
        "bells": (per_region, bells_at),
        "sent": (per_region, sent_at),
        "took": (per_region, took_at),
        "watch": (per_region, watch_at),
        "ring": (("u1", (RING * ENTRY,)), ring_at),
    }
    return np.dtype(
        {
            "names": list(fields),
            "formats": [f for f, _ in fields.values()],
            "offsets": [o for _, o in fields.values()],
            "itemsize": size,
        }
    )


def table_name(epoch: str, pid: int) -> str:
    """The table's file name: its pool's pid, so that a pool that died without removing its table (SIGKILL, the
    OOM killer) is known for dead by the next one in the directory (:func:`remove_stale_tables`)."""
    return f"{TABLE_PREFIX}{pid}-{epoch}"


def remove_stale_tables(directory: Path) -> list[Path]:
    """Delete this user's tables whose pool is gone (its pid names no process); returns them."""
    removed = []
    for path in Path(directory).glob(f"{TABLE_PREFIX}*-*"):
        try:
            pid = int(path.name[len(TABLE_PREFIX) :].split("-", 1)[0])
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
            removed.append(path)
        except (ValueError, OSError):
            continue
    return removed


def create_table(directory: Path, epoch: str, regions: int, slots: int) -> tuple[Path, mmap.mmap, np.ndarray]:
    """The pool's side: a new table, mode 0600, zeroed (sparse until written), and its regions as an array; the
    tables of dead pools in the directory are removed first."""
    dtype = region_dtype(slots, regions)
    for stale in remove_stale_tables(directory):
        log.info("removed the slab table %s of a pool that is gone", stale)
    path = Path(directory) / table_name(epoch, os.getpid())
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, PAGE + regions * dtype.itemsize)
        mm = mmap.mmap(fd, PAGE + regions * dtype.itemsize)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    mm[: FILE_HEAD.size] = FILE_HEAD.pack(MAGIC, regions, slots, dtype.itemsize, epoch[:16].encode())
    return path, mm, np.frombuffer(mm, dtype=dtype, count=regions, offset=PAGE)


class TableView:
    """A session's side: its own region mapped read-write, and the whole table read-only (to check a producer's
    region before taking the ids it sent)."""

    def __init__(self, path: str, region: int, epoch: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise InvalidRequest(f"the slab table {path} must be this user's, mode 0600")
            head = os.pread(fd, FILE_HEAD.size, 0)
            magic, regions, slots, region_bytes, ep = FILE_HEAD.unpack(head)
            if magic != MAGIC or ep.rstrip(b"\0") != epoch[:16].encode() or not 0 <= region < regions:
                raise InvalidRequest(f"{path} is not the slab table of pool epoch {epoch}")
            self.dtype = region_dtype(slots, regions)
            assert self.dtype.itemsize == region_bytes
            self.ro = mmap.mmap(fd, PAGE + regions * region_bytes, prot=mmap.PROT_READ)  # the whole table
            self.rw = mmap.mmap(fd, region_bytes, offset=PAGE + region * region_bytes)  # this session's region
        finally:
            os.close(fd)
        self.regions = regions
        self.slots = slots
        self.region = region
        self.region_words = region_bytes // 8
        self.table = np.frombuffer(self.ro, dtype=self.dtype, count=regions, offset=PAGE)
        self.mine = np.frombuffer(self.rw, dtype=self.dtype, count=1)[0]
        # the same memory as 8-byte words, for the hot path (a memoryview item costs tens of nanoseconds, a numpy
        # field of a record a microsecond): own header nonce, want, done, hseq at 0..3, slot s at 8 + 4 s
        self.words = memoryview(self.rw).cast("Q")
        self.all_words = memoryview(self.ro).cast("Q")  # region r starts at PAGE / 8 + r * region_words
        self.halves = memoryview(self.rw).cast("I")  # slot s's state (the low half of its word 1) at 18 + 8 s
        fields = self.dtype.fields
        assert fields is not None
        #: where a region's bells, sent, took and watch start (in words) and its ring (in bytes), from its start
        self.bells, self.sent, self.took, self.watch = (fields[n][1] // 8 for n in ("bells", "sent", "took", "watch"))
        self.ring = fields["ring"][1]

    def base(self, region: int) -> int:
        """Where ``region`` starts in :attr:`all_words`."""
        return PAGE // 8 + region * self.region_words

    def close(self) -> None:
        # numpy views keep the maps' buffers exported: drop them first, and leave the maps to the collector if a
        # caller still holds a view
        del self.table, self.mine
        for view in (self.words, self.all_words, self.halves):
            view.release()
        for mm in (self.ro, self.rw):
            with contextlib.suppress(BufferError):
                mm.close()
