"""Reservation slabs and the lease table, the pool's side: what a session may do without a round trip, and how the
pool stays the one authority over every block anyway.

A session's slab is blocks the pool allocated to that session in one call (``grant``): in the books they are the
session's refs like any others (in use), so ``free + in_use + cached == num_blocks`` holds throughout. The session
then allocates and frees them locally, recording each slot's state in its region of the lease table
(:mod:`kvpool.leases`); it returns idle ones in bulk (``grant`` with ``give``), and when the pool needs room it
raises the region's ``want`` and the session gives back its idle blocks at its next call.

A handoff between two slabs moves no ref at the moment it happens: the producer marks the slots handed and sends
the ids to the consumer (a datagram, :mod:`kvpool.slabwire`, or an entry of its ring in the table that the
consumer reads, :mod:`kvpool.slabsend`; the pool reads neither). The pool moves the refs afterwards
(:meth:`LeaseBooks.settle`): at its sweep, when the consumer asks (before it names those blocks in a call), and
when the producer's session ends. It acts on a handed slot only for a block its own books say the producer holds
in its slab, uncommitted, with the generation the slot names; it gives the block to the consumer the slot names if
that session still occupies its region, else frees it; and it records the sequence as settled in the slot (a field
only it writes), after which the producer may reuse the slot. So a dead producer's handed blocks reach their
consumer, a dead consumer's handed blocks come back, and whatever a session writes into its region can move only its
own blocks.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpool.errors import InvalidRequest, LimitExceeded, NotOwner, UnknownSession
from kvpool.ids import BLOCK_BITS, BLOCK_MASK, GEN_BITS, GEN_MASK
from kvpool.leases import ALLOCATED, EMPTY, HANDED, IDLE, create_table
from kvpool.server.config import PoolSettings
from kvpool.server.pool import Pool
from kvpool.server.records import Session, holder_of
from kvpool.slabwire import pair_key

log = logging.getLogger(__name__)

ENDED_KEPT = 4096


@dataclass(slots=True)
class Lease:
    session_id: str
    region: int
    nonce: int
    box: str | None
    slab: set[int] = field(default_factory=set)  # blocks granted to the slab (a superset: pruned on each grant)
    seen: np.ndarray | None = None  # the slots' ids as the pool last took their generations in
    counted: int = 0  # the last handoff sequence counted in the pool's counters


@dataclass(slots=True)
class LeaseCounters:
    grants: int = 0
    blocks_granted: int = 0
    blocks_returned: int = 0
    wants_raised: int = 0
    handed_settled: int = 0
    handed_released: int = 0
    handed_ignored: int = 0
    generations_taken: int = 0


class LeaseBooks:
    def __init__(self, pool: Pool, directory: Path, regions: int, slots: int, box_dir: Path | None) -> None:
        self.pool = pool
        self.slots = slots
        self.box_dir = box_dir
        self.path, self._mm, self.table = create_table(directory, pool.epoch, regions, slots)
        self._free_regions = deque(range(regions))  # FIFO: a region just given up is the last one reused
        self.leases: dict[str, Lease] = {}
        self.at: dict[int, Lease] = {}
        self.counters = LeaseCounters()
        self._secret = secrets.token_bytes(32)
        #: nonces of sessions that ended lately: a consumer may still have to check a handoff they sent
        self._ended: OrderedDict[int, str] = OrderedDict()

    # -- sessions ---------------------------------------------------------------------------------------

    def open(self, session_id: str) -> Lease:
        """The session's region (a new one, zeroed, with a fresh nonce; or the one it has)."""
        self.pool.session(session_id)
        lease = self.leases.get(session_id)
        if lease is not None:
            return lease
        if not self._free_regions:
            raise LimitExceeded(
                f"all {len(self.table)} lease regions are taken: this session works without a slab (raise "
                "--lease-regions, KVPOOL_LEASE_REGIONS)"
            )
        region = self._free_regions.popleft()
        self.table[region] = np.zeros((), self.table.dtype)
        nonce = secrets.randbits(63) | 1
        box = str(self.box_dir / f"lease-{secrets.token_hex(8)}.sock") if self.box_dir is not None else None
        lease = Lease(session_id, region, nonce, box, seen=np.zeros(self.slots, np.int64))
        self.table[region]["nonce"] = nonce
        self.leases[session_id] = lease
        self.at[region] = lease
        return lease

    def _lease(self, session_id: str) -> Lease:
        self.pool.session(session_id)
        lease = self.leases.get(session_id)
        if lease is None:
            raise InvalidRequest("this session has no lease region: open one first (POST /leases)")
        return lease

    def release(self, session: Session) -> None:
        """Before a session's refs are released: move what it handed to live consumers, then give up its region."""
        lease = self.leases.get(session.session_id)
        if lease is None:
            return
        self.settle(lease.region)
        del self.leases[session.session_id]
        del self.at[lease.region]
        self.table[lease.region] = np.zeros((), self.table.dtype)
        self._free_regions.append(lease.region)
        self._ended[lease.nonce] = lease.session_id
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        if lease.box is not None:
            Path(lease.box).unlink(missing_ok=True)

    # -- slabs ------------------------------------------------------------------------------------------

    def grant(self, session_id: str, take: int, give: Sequence[int], arena: int = 0) -> list[int]:
        """Take up to ``take`` more blocks into the session's slab (as many as it has room for and the arena has
        free or evictable), and return ``give`` (idle slab blocks) to the pool."""
        lease = self._lease(session_id)
        holder = self.pool.session(session_id).holder
        allocator = self.pool.allocator
        if give:
            self.settle(lease.region)  # a block it handed is its consumer's: never back to the pool from here
        blocks = self.pool.unfence(give) if give else []
        if len(set(blocks)) != len(blocks):
            raise InvalidRequest("give lists a block twice")
        outside = [b for b in blocks if b not in lease.slab]
        if outside:
            raise NotOwner(f"blocks {outside[:8]} are not in this session's slab: free them with /free instead")
        allocator.check_held(holder, blocks)
        self._prune(lease, holder)
        take = min(take, max(0, self.slots - len(lease.slab) + len(blocks)))  # a slab holds at most `slots` blocks
        if 0 < allocator.available(arena) < take:
            take = allocator.available(arena)  # what there is; none at all is PoolExhausted (507) below
        new: list[int] = []
        if take:
            try:
                new = allocator.allocate(holder, take, arena)
            except Exception:
                self.want_back(exclude=session_id)
                raise
        if blocks:
            allocator.free(holder, blocks)
            lease.slab.difference_update(blocks)
        lease.slab.update(new)
        c = self.counters
        c.grants += 1
        c.blocks_granted += len(new)
        c.blocks_returned += len(blocks)
        return allocator.fenced(new)

    def _prune(self, lease: Lease, holder: str) -> None:
        """Forget slab blocks that left the slab through the pool (committed, handed off, freed by /free)."""
        held, committed = self.pool.allocator.refs_of(holder), self.pool.allocator.committed
        lease.slab = {b for b in lease.slab if b in held and not committed[b]}

    def want_back(self, exclude: str | None = None) -> int:
        """Ask every session with idle slab blocks to return them at its next call; how many were asked."""
        asked = 0
        for lease in self.leases.values():
            if lease.session_id == exclude:
                continue
            region = self.table[lease.region]
            if np.any(region["slots"]["state"] == IDLE):
                region["want"] += 1
                asked += 1
        self.counters.wants_raised += asked
        return asked

    # -- handoffs between slabs -------------------------------------------------------------------------

    def pair_to(self, session_id: str, to: str) -> tuple[Lease, bytes]:
        """For a producer: the consumer called ``to`` (its region, nonce and box) and the pair's key."""
        self.pool.session(session_id)
        consumer = self.pool.named(to)
        lease = self.leases.get(consumer.session_id)
        if lease is None or lease.box is None:
            raise InvalidRequest(f"session {to!r} has no lease box: hand off to it through the pool")
        if consumer.session_id == session_id:  # its refs would stay its own: a handed id would still free
            raise InvalidRequest("a session hands off to itself through the pool, where the refs wait for its claim")
        return lease, pair_key(self._secret, session_id, consumer.session_id)

    def pair_from(self, session_id: str, region: int, nonce: int) -> bytes:
        """For a consumer: the key of the pair with the producer that occupies ``region`` under ``nonce``."""
        self.pool.session(session_id)
        producer = self.at.get(region)
        sid = producer.session_id if producer is not None and producer.nonce == nonce else self._ended.get(nonce)
        if sid is None:
            raise UnknownSession(f"no session held lease region {region} under that nonce lately")
        return pair_key(self._secret, sid, session_id)

    def settle(self, region: int) -> int:
        """Move the refs of the blocks handed from ``region`` (see the module's docstring); how many slots."""
        lease = self.at.get(region)
        if lease is None:
            return 0
        mine = self.table[region]
        slots = mine["slots"]
        self._sync(lease, slots)
        handed = np.flatnonzero(slots["state"] == HANDED)
        if not handed.size:
            return 0
        seen = slots[handed]  # a copy: the producer keeps writing
        settled = mine["settled"]
        todo = seen["seq"] != settled[handed]
        handed, seen = handed[todo], seen[todo]
        if not handed.size:
            return 0
        pool, allocator = self.pool, self.pool.allocator
        holder = holder_of(lease.session_id)
        held, committed, fence_of = allocator.refs_of(holder), allocator.committed, allocator.fence_of
        moves: dict[str, list[int]] = {}
        drops: list[int] = []
        claimed: set[int] = set()  # the sequences of the handoffs whose refs reach their consumer
        made: set[int] = set()
        for slot, entry in zip(handed.tolist(), seen.tolist(), strict=True):
            fenced, _, to_region, seq, to_nonce = entry
            block = fenced & BLOCK_MASK
            ok = block in lease.slab and block in held and not committed[block] and fence_of[block] == fenced
            if ok:
                lease.slab.discard(block)
                # a consumer whose lease ran out but that the sweep has not ended yet still gets them: its refs go
                # when it ends, and a late heartbeat must not cost it blocks it already took
                consumer = self.at.get(to_region)
                if consumer is not None and consumer.nonce == to_nonce and consumer.session_id in pool.sessions:
                    moves.setdefault(holder_of(consumer.session_id), []).append(block)
                    claimed.add(seq)
                else:
                    drops.append(block)
                made.add(seq)
            else:
                self.counters.handed_ignored += 1
            settled[slot] = seq
        for dst, blocks in moves.items():
            allocator.transfer(holder, dst, blocks)
            self.counters.handed_settled += len(blocks)
        if drops:
            allocator.free(holder, drops)
            self.counters.handed_released += len(drops)
        # in the pool's own counters as a handoff and its claim, as if they had passed through /handoff and /claim;
        # once each, though a settle may come while the producer is still marking a handoff's slots
        new = [seq for seq in made if seq > lease.counted]
        if new:
            pool.counters.handoffs += len(new)
            pool.counters.claims += len(claimed.intersection(new))
            lease.counted = max(new)
        return int(handed.size)

    def _sync(self, lease: Lease, slots: np.ndarray) -> None:
        """Take in the generations the session moved in its slab: a block freed into a slab gets its next one there,
        written into its slot, and from then on the pool must refuse the old id too. Believed only for a block the
        books put in that slab, uncommitted and held by it, and only forward (serial arithmetic, 31 bits): whatever
        a session writes can make only its own ids stale."""
        ids = slots["block"].copy()  # the session keeps writing
        assert lease.seen is not None
        changed = np.flatnonzero(ids != lease.seen)
        if not changed.size:
            return
        changed = changed[slots["state"][changed] != EMPTY]
        lease.seen[changed] = ids[changed]
        allocator = self.pool.allocator
        held, committed = allocator.refs_of(holder_of(lease.session_id)), allocator.committed
        fence_of = allocator.fence_of
        for fenced in ids[changed].tolist():
            block = fenced & BLOCK_MASK
            if fenced < 0 or block not in lease.slab or block not in held or committed[block]:
                continue
            ahead = ((fenced >> BLOCK_BITS) - (fence_of[block] >> BLOCK_BITS)) & GEN_MASK
            if 0 < ahead < 1 << (GEN_BITS - 1):
                fence_of[block] = fenced
                self.counters.generations_taken += 1

    def settle_session(self, session_id: str) -> None:
        """Before a session frees, commits or hands off blocks through the pool: what it handed from its slab is
        its consumers' (or back in the pool) first, so it cannot give those blocks up a second time."""
        lease = self.leases.get(session_id)
        if lease is not None:
            self.settle(lease.region)

    def settle_all(self) -> int:
        states = self.table["slots"]["state"]
        regions = np.flatnonzero(np.any(states == HANDED, axis=1))
        return sum(self.settle(int(r)) for r in regions)

    def holds(self, session_id: str, ids: Sequence[int]) -> bool:
        """Whether the session holds a ref on each of these ids, at their generation (a consumer's slow check)."""
        holder = self.pool.session(session_id).holder
        try:
            blocks = self.pool.allocator.unfence(ids)
        except Exception:
            return False
        held = self.pool.allocator.refs_of(holder)
        return all(b in held for b in blocks)

    # -- introspection ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        used = [lease.region for lease in self.leases.values()]
        regions = self.table[used]
        states = regions["slots"]["state"]
        unsettled = (states == HANDED) & (regions["slots"]["seq"] != regions["settled"])
        c = self.counters
        return {
            "regions": len(used),
            "regions_free": len(self._free_regions),
            "slab_idle": int(np.count_nonzero(states == IDLE)),
            "slab_allocated": int(np.count_nonzero(states == ALLOCATED)),
            "slab_handed": int(np.count_nonzero(unsettled)),
            "counters": {name: getattr(c, name) for name in LeaseCounters.__slots__},
        }

    def close(self) -> None:
        if not hasattr(self, "table"):
            return
        for lease in self.leases.values():
            if lease.box is not None:
                Path(lease.box).unlink(missing_ok=True)
        del self.table
        with contextlib.suppress(BufferError):  # a view is still held somewhere: the map goes with it
            self._mm.close()
        self.path.unlink(missing_ok=True)


def open_leases(settings: PoolSettings, pool: Pool) -> LeaseBooks | None:
    """The lease table of a pool that serves slabs (``--leases``), hooked into its books; None if it does not."""
    if not settings.leases:
        return None
    sock = settings.fast_socket or settings.socket
    books = LeaseBooks(pool, settings.shm_dir, settings.lease_regions, settings.slab_max_blocks,
                       sock.parent if sock is not None else None)  # fmt: skip
    pool.on_release = books.release
    pool.on_gives_up = books.settle_session
    pool.on_exhausted = lambda session_id: books.want_back(exclude=session_id) and None
    log.info("lease table at %s: %d regions of %d slots", books.path, len(books.table), books.slots)
    return books
