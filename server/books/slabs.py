"""Reservation slabs and the slab table, the pool's side: what a session may do without a round trip, and how the
pool stays the one authority over every block anyway.

Past 400 lines, not yet split: a slab's grants and the settling of handoffs between slabs act on the same table and
occupants; issue 47's split of the reservation from slab-to-slab handoffs is where it divides.

A session's slab is blocks the pool allocated to that session in one call (``grant``): in the books they are the
session's refs like any others (in use), so ``free + in_use + cached == num_blocks`` holds throughout. The session
then allocates and frees them locally, recording each slot's state in its region of the slab table
(:mod:`kvpool.slab.table`); it returns idle ones in bulk (``grant`` with ``give``), and when the pool needs room it
raises the region's ``want`` and the session gives back its idle blocks at its next call.

A handoff between two slabs moves no ref at the moment it happens: the producer marks the slots handed and sends
the ids to the consumer (a datagram, :mod:`kvpool.slab.wire`, or an entry of its ring in the table that the
consumer reads, :mod:`kvpool.slab.send`; the pool reads neither). The pool moves the refs afterwards
(:meth:`SlabBooks.settle`): at its sweep, when the consumer asks (before it names those blocks in a call), and
when the producer's session ends. It acts on a handed slot only for a block its own books say the producer holds
in its slab, uncommitted, with the generation the slot names, so whatever a session writes into its region can move
only its own blocks; and it records the sequence as settled in the slot (a field only it writes), after which the
producer may reuse the slot.

The refs reach the consumer's session only once the consumer took the handoff (its ``took`` word for that producer
says so, or it names the handoff when it asks the pool to vouch): until then they are *in flight*, held by the pool
under a holder of their own, so a live session never holds a block it was not told of. A consumer that ends frees
what was in flight to it. A producer that ends first (killed, or closed) leaves each handoff its consumer had not
taken yet where the consumer can still find it: one written into its ring is parked in the pool for that consumer
under its request id (the ring goes with the producer's region), one that went as a datagram waits for the consumer
to read it from its slab box, and one that never left the producer (a datagram still queued) is freed.
"""

from __future__ import annotations

import contextlib
import json
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
from kvpool.server.books.records import Handoff, Session, holder_of
from kvpool.slab.table import ALLOCATED, EMPTY, ENTRY, ENTRY_HEAD, ENTRY_ROOM, HANDED, IDLE, RING, create_table, fence
from kvpool.slab.wire import pair_key

#: the :class:`kvpool.server.books.pool.Pool` that owns this part (it imports this module, so not the other way)
Pool = Any

log = logging.getLogger(__name__)

ENDED_KEPT = 4096


@dataclass(slots=True)
class InFlight:
    """The blocks of one handoff between slabs that left the producer's slab before its consumer took it."""

    producer: int  # the producer's nonce
    seq: int
    consumer: str  # the consumer's session id, region and nonce
    region: int
    nonce: int
    blocks: list[int] = field(default_factory=list)

    @property
    def holder(self) -> str:
        return f"x:{self.producer:x}:{self.seq}:{self.region}"


@dataclass(slots=True)
class Occupant:
    """The session that occupies a region of the slab table, and the pool's books of its slab."""

    session_id: str
    region: int
    nonce: int
    box: str | None
    slab: set[int] = field(default_factory=set)  # blocks granted to the slab (a superset: pruned on each grant)
    seen: np.ndarray | None = None  # the slots' ids as the pool last took their generations in
    counted: int = 0  # the last handoff sequence counted in the pool's counters
    #: its handoffs in flight, by (sequence, consumer region, consumer nonce)
    in_flight: dict[tuple[int, int, int], InFlight] = field(default_factory=dict)
    claimed: set[int] = field(default_factory=set)  # sequences counted as claims (a handoff may settle in parts)


@dataclass(slots=True)
class SlabCounters:
    grants: int = 0
    blocks_granted: int = 0
    blocks_returned: int = 0
    wants_raised: int = 0
    handed_settled: int = 0
    handed_released: int = 0
    handed_ignored: int = 0
    handed_parked: int = 0  # blocks of a ring handoff whose producer ended first, parked for its consumer
    generations_taken: int = 0


class SlabBooks:
    def __init__(self, pool: Pool, directory: Path, regions: int, slots: int, box_dir: Path | None) -> None:
        self.pool = pool
        self.slots = slots
        self.box_dir = box_dir
        self.path, self._mm, self.table = create_table(directory, pool.epoch, regions, slots)
        self._free_regions = deque(range(regions))  # FIFO: a region just given up is the last one reused
        self.occupants: dict[str, Occupant] = {}
        self.at: dict[int, Occupant] = {}
        self.counters = SlabCounters()
        self._secret = secrets.token_bytes(32)
        #: nonces of sessions that ended lately: a consumer may still have to check a handoff they sent
        self._ended: OrderedDict[int, str] = OrderedDict()
        #: handoffs that went as datagrams from producers that ended before their consumer took them, by consumer:
        #: still in flight, until the consumer reads the datagram and names them (:meth:`holds`) or ends
        self.unread: dict[str, list[InFlight]] = {}

    # -- sessions ---------------------------------------------------------------------------------------

    def open(self, session_id: str) -> Occupant:
        """The session's region (a new one, zeroed, with a fresh nonce; or the one it has)."""
        self.pool.session(session_id)
        occupant = self.occupants.get(session_id)
        if occupant is not None:
            return occupant
        if not self._free_regions:
            raise LimitExceeded(
                f"all {len(self.table)} slab regions are taken: this session works without a slab (raise "
                "--slab-regions, KVPOOL_SLAB_REGIONS)"
            )
        region = self._free_regions.popleft()
        self.table[region] = np.zeros((), self.table.dtype)
        nonce = secrets.randbits(63) | 1
        box = str(self.box_dir / f"slab-{secrets.token_hex(8)}.sock") if self.box_dir is not None else None
        occupant = Occupant(session_id, region, nonce, box, seen=np.zeros(self.slots, np.int64))
        self.table[region]["nonce"] = nonce
        self.occupants[session_id] = occupant
        self.at[region] = occupant
        return occupant

    def _occupant(self, session_id: str) -> Occupant:
        self.pool.session(session_id)
        occupant = self.occupants.get(session_id)
        if occupant is None:
            raise InvalidRequest("this session has no slab region: open one first (POST /slabs)")
        return occupant

    def release(self, session: Session) -> None:
        """Before a session's refs are released: settle what it handed (see the module's docstring), free what was
        in flight to it, then give up its region.

        Its nonce goes first, and only then does the pool read whether its consumers took its handoffs: a consumer
        writes what it took and then reads the producer's nonce (each fences between), so either the pool sees the
        take and gives it the blocks, or the consumer sees the producer gone and asks the pool, which by then has
        decided."""
        occupant = self.occupants.get(session.session_id)
        if occupant is None:
            return
        self.table[occupant.region]["nonce"] = 0
        fence()
        self.settle(occupant.region, ending=True)
        for flight in self.unread.pop(session.session_id, ()):
            self._release(flight)
        del self.occupants[session.session_id]
        del self.at[occupant.region]
        self.table[occupant.region] = np.zeros((), self.table.dtype)
        self._free_regions.append(occupant.region)
        self._ended[occupant.nonce] = occupant.session_id
        while len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)
        if occupant.box is not None:
            Path(occupant.box).unlink(missing_ok=True)

    # -- slabs ------------------------------------------------------------------------------------------

    def grant(self, session_id: str, take: int, give: Sequence[int], arena: int = 0) -> list[int]:
        """Take up to ``take`` more blocks into the session's slab (as many as it has room for and the arena has
        free or evictable), and return ``give`` (idle slab blocks) to the pool."""
        occupant = self._occupant(session_id)
        holder = self.pool.session(session_id).holder
        allocator = self.pool.allocator
        if give:
            self.settle(occupant.region)  # a block it handed is its consumer's: never back to the pool from here
        blocks = self.pool.unfence(give) if give else []
        if len(set(blocks)) != len(blocks):
            raise InvalidRequest("give lists a block twice")
        outside = [b for b in blocks if b not in occupant.slab]
        if outside:
            raise NotOwner(f"blocks {outside[:8]} are not in this session's slab: free them with /free instead")
        allocator.check_held(holder, blocks)
        self._prune(occupant, holder)
        take = min(take, max(0, self.slots - len(occupant.slab) + len(blocks)))  # a slab holds at most `slots` blocks
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
            occupant.slab.difference_update(blocks)
        occupant.slab.update(new)
        c = self.counters
        c.grants += 1
        c.blocks_granted += len(new)
        c.blocks_returned += len(blocks)
        return allocator.fenced(new)

    def _prune(self, occupant: Occupant, holder: str) -> None:
        """Forget slab blocks that left the slab through the pool (committed, handed off, freed by /free)."""
        held, committed = self.pool.allocator.refs_of(holder), self.pool.allocator.committed
        occupant.slab = {b for b in occupant.slab if b in held and not committed[b]}

    def want_back(self, exclude: str | None = None) -> int:
        """Ask every session with idle slab blocks to return them at its next call; how many were asked."""
        asked = 0
        for occupant in self.occupants.values():
            if occupant.session_id == exclude:
                continue
            region = self.table[occupant.region]
            if np.any(region["slots"]["state"] == IDLE):
                region["want"] += 1
                asked += 1
        self.counters.wants_raised += asked
        return asked

    # -- handoffs between slabs -------------------------------------------------------------------------

    def pair_to(self, session_id: str, to: str) -> tuple[Occupant, bytes]:
        """For a producer: the consumer called ``to`` (its region, nonce and box) and the pair's key."""
        self.pool.session(session_id)
        consumer = self.pool.named(to)
        occupant = self.occupants.get(consumer.session_id)
        if occupant is None or occupant.box is None:
            raise InvalidRequest(f"session {to!r} has no slab box: hand off to it through the pool")
        if consumer.session_id == session_id:  # its refs would stay its own: a handed id would still free
            raise InvalidRequest("a session hands off to itself through the pool, where the refs wait for its claim")
        return occupant, pair_key(self._secret, session_id, consumer.session_id)

    def pair_from(self, session_id: str, region: int, nonce: int) -> bytes:
        """For a consumer: the key of the pair with the producer that occupies ``region`` under ``nonce``."""
        self.pool.session(session_id)
        producer = self.at.get(region)
        sid = producer.session_id if producer is not None and producer.nonce == nonce else self._ended.get(nonce)
        if sid is None:
            raise UnknownSession(f"no session held slab region {region} under that nonce lately")
        return pair_key(self._secret, sid, session_id)

    def settle(self, region: int, ending: bool = False) -> int:
        """Settle the slots handed from ``region`` and its handoffs in flight (see the module's docstring); how many
        slots. ``ending``: the producer's session ends, so what its consumers have not taken is decided now."""
        occupant = self.at.get(region)
        if occupant is None:
            return 0
        mine = self.table[region]
        slots = mine["slots"]
        self._sync(occupant, slots)
        handed = np.flatnonzero(slots["state"] == HANDED)
        if handed.size:
            seen = slots[handed]  # a copy: the producer keeps writing
            todo = seen["seq"] != mine["settled"][handed]
            handed, seen = handed[todo], seen[todo]
            if handed.size:
                self._take_handed(occupant, handed, seen)
        if occupant.in_flight:
            self._resolve(occupant, ending)
        return int(handed.size)

    def _take_handed(self, occupant: Occupant, handed: np.ndarray, seen: np.ndarray) -> None:
        """The handed slots' blocks leave the producer's slab: in flight to their consumer, or back to the pool if
        that session is gone."""
        pool, allocator = self.pool, self.pool.allocator
        holder = holder_of(occupant.session_id)
        held, committed, fence_of = allocator.refs_of(holder), allocator.committed, allocator.fence_of
        settled = self.table[occupant.region]["settled"]
        going: dict[tuple[int, int, int], list[int]] = {}
        drops: list[int] = []
        made: set[int] = set()
        for slot, entry in zip(handed.tolist(), seen.tolist(), strict=True):
            fenced, _, to_region, seq, to_nonce = entry
            block = fenced & BLOCK_MASK
            ok = block in occupant.slab and block in held and not committed[block] and fence_of[block] == fenced
            if ok:
                occupant.slab.discard(block)
                # a consumer whose lease ran out but that the sweep has not ended yet still gets them: its refs go
                # when it ends, and a late heartbeat must not cost it blocks it already took
                consumer = self.at.get(to_region)
                if consumer is not None and consumer.nonce == to_nonce and consumer.session_id in pool.sessions:
                    going.setdefault((seq, to_region, to_nonce), []).append(block)
                else:
                    drops.append(block)
                made.add(seq)
            else:
                self.counters.handed_ignored += 1
            settled[slot] = seq
        for key, blocks in going.items():
            flight = occupant.in_flight.get(key)
            if flight is None:
                consumer = self.at[key[1]]
                flight = occupant.in_flight[key] = InFlight(occupant.nonce, key[0], consumer.session_id, key[1], key[2])
            allocator.transfer(holder, flight.holder, blocks)
            flight.blocks += blocks
        if drops:
            allocator.free(holder, drops)
            self.counters.handed_released += len(drops)
        # in the pool's own counters as a handoff (here) and its claim (once its consumer takes it), as if they had
        # passed through /handoff and /claim; once each, though a settle may come while the producer is still
        # marking a handoff's slots
        new = [seq for seq in made if seq > occupant.counted]
        if new:
            pool.counters.handoffs += len(new)
            occupant.counted = max(new)

    def _resolve(self, occupant: Occupant, ending: bool) -> None:
        """Each handoff in flight from ``occupant``: to its consumer once it took it, freed if it is gone; and if the
        producer ends, parked for the consumer (a ring's entry), left for it to read (a datagram that left), or
        freed (one that never left)."""
        pool = self.pool
        region = self.table[occupant.region]
        for key, flight in list(occupant.in_flight.items()):
            consumer = self.at.get(flight.region)
            if consumer is None or consumer.nonce != flight.nonce or consumer.session_id not in pool.sessions:
                del occupant.in_flight[key]
                self._release(flight)
            elif self._taken(consumer, occupant, flight.seq):
                del occupant.in_flight[key]
                self._deliver(flight, occupant)
            elif ending:
                del occupant.in_flight[key]
                entry = self._ring_entry(occupant, flight)
                if entry is not None:
                    if not self._park(occupant, flight, *entry):
                        self._release(flight)
                elif int(region["sent"][flight.region]) >= flight.seq:
                    self.unread.setdefault(flight.consumer, []).append(flight)
                else:
                    self._release(flight)
        if len(occupant.claimed) > RING:  # only the handoff its producer marks now can settle in parts: the latest
            occupant.claimed = {s for s in occupant.claimed if s >= occupant.counted}

    def _taken(self, consumer: Occupant, producer: Occupant, seq: int) -> bool:
        """Whether the consumer says it took the producer's handoff ``seq`` (its watch first, then its took: it
        writes them in the other order)."""
        words = self.table[consumer.region]
        return int(words["watch"][producer.region]) == producer.nonce and int(words["took"][producer.region]) >= seq

    def _deliver(self, flight: InFlight, producer: Occupant | None) -> None:
        self.pool.allocator.transfer(flight.holder, holder_of(flight.consumer), flight.blocks)
        self.counters.handed_settled += len(flight.blocks)
        if producer is None or flight.seq not in producer.claimed:
            self.pool.counters.claims += 1
            if producer is not None:
                producer.claimed.add(flight.seq)

    def _release(self, flight: InFlight) -> None:
        self.pool.allocator.free(flight.holder, flight.blocks)
        self.counters.handed_released += len(flight.blocks)

    def _ring_entry(self, occupant: Occupant, flight: InFlight) -> tuple[str, int, dict[str, Any], list[int]] | None:
        """The request id, num_tokens, meta and ids (in their order) of the producer's ring entry for this handoff,
        if it wrote it there and its ids are exactly the blocks in flight; else None (a datagram, or a lie)."""
        ring = self.table[occupant.region]["ring"]
        at = flight.seq % RING * ENTRY
        raw = ring[at : at + ENTRY].tobytes()
        seq, _, _, nonce, num_tokens, region, n, run, rid_len, meta_len = ENTRY_HEAD.unpack_from(raw)
        if seq != flight.seq or region != flight.region or nonce != flight.nonce or n != len(flight.blocks):
            return None
        listed = 4 * n if run < 0 else 0
        if 8 * n + listed + rid_len + meta_len > ENTRY_ROOM:
            return None
        at = ENTRY_HEAD.size
        ids = np.frombuffer(raw, np.int64, n, at).tolist()
        at += 8 * n + listed
        try:
            request_id = raw[at : at + rid_len].decode()
            meta = json.loads(raw[at + rid_len : at + rid_len + meta_len]) if meta_len else {}
        except (ValueError, RecursionError):
            return None
        fence_of = self.pool.allocator.fence_of
        if sorted(ids) != sorted(fence_of[b] for b in flight.blocks) or not isinstance(meta, dict) or not request_id:
            return None
        return request_id, num_tokens, meta, ids

    def _park(self, occupant: Occupant, flight: InFlight, request_id: str, num_tokens: int, meta: dict[str, Any],
              ids: list[int]) -> bool:  # fmt: skip
        """Park a ring's handoff whose producer ended for its consumer, as ``/handoff`` with ``to`` would; False if
        the pool would refuse that handoff (its request id taken, a limit)."""
        pool = self.pool
        meta_json = json.dumps(meta, separators=(",", ":")).encode() if meta else b""
        parking = pool.parking
        waiting = parking.addressed.get(flight.consumer, ())
        if (
            request_id in pool.handoffs
            or len(pool.handoffs) >= pool.limits.max_handoffs
            or len(waiting) >= pool.limits.max_handoffs_per_session
            or len(meta_json) > pool.limits.max_meta_bytes
            or not 0 <= num_tokens <= len(ids) * pool.layout.block_size
        ):
            log.warning("freed slab handoff %r from an ended session: the pool cannot park it", request_id)
            return False
        parking.seq += 1
        handoff = Handoff(request_id=request_id, block_ids=ids, num_tokens=num_tokens, meta=meta,
                          from_session=occupant.session_id, expires_at=pool.clock() + pool.handoff_ttl_s,
                          ttl_s=pool.handoff_ttl_s, to=flight.consumer, seq=parking.seq, meta_json=meta_json,
                          blocks=[i & BLOCK_MASK for i in ids])  # fmt: skip
        pool.allocator.transfer(flight.holder, handoff.holder, handoff.blocks)
        pool.refused.pop(request_id, None)
        parking.park(handoff)
        self.counters.handed_parked += len(ids)
        if pool.on_handoff is not None:
            pool.on_handoff(request_id)
        return True

    def _sync(self, occupant: Occupant, slots: np.ndarray) -> None:
        """Take in the generations the session moved in its slab: a block freed into a slab gets its next one there,
        written into its slot, and from then on the pool must refuse the old id too. Believed only for a block the
        books put in that slab, uncommitted and held by it, and only forward (serial arithmetic, 31 bits): whatever
        a session writes can make only its own ids stale."""
        ids = slots["block"].copy()  # the session keeps writing
        assert occupant.seen is not None
        changed = np.flatnonzero(ids != occupant.seen)
        if not changed.size:
            return
        changed = changed[slots["state"][changed] != EMPTY]
        occupant.seen[changed] = ids[changed]
        allocator = self.pool.allocator
        held, committed = allocator.refs_of(holder_of(occupant.session_id)), allocator.committed
        fence_of = allocator.fence_of
        for fenced in ids[changed].tolist():
            block = fenced & BLOCK_MASK
            if fenced < 0 or block not in occupant.slab or block not in held or committed[block]:
                continue
            ahead = ((fenced >> BLOCK_BITS) - (fence_of[block] >> BLOCK_BITS)) & GEN_MASK
            if 0 < ahead < 1 << (GEN_BITS - 1):
                fence_of[block] = fenced
                self.counters.generations_taken += 1

    def settle_session(self, session_id: str) -> None:
        """Before a session frees, commits or hands off blocks through the pool: what it handed from its slab is
        its consumers' (or back in the pool) first, so it cannot give those blocks up a second time."""
        occupant = self.occupants.get(session_id)
        if occupant is not None:
            self.settle(occupant.region)

    def settle_all(self) -> int:
        states = self.table["slots"]["state"]
        regions = set(np.flatnonzero(np.any(states == HANDED, axis=1)).tolist())
        regions.update(occupant.region for occupant in self.occupants.values() if occupant.in_flight)
        return sum(self.settle(r) for r in regions)

    def holds(self, session_id: str, ids: Sequence[int], took: Sequence[int] | None = None) -> bool:
        """Whether the session holds a ref on each of these ids, at their generation (a consumer's slow check).

        ``took``: the (producer region, producer nonce, sequence) of the handoff the consumer read these ids from;
        if it is in flight to this session with exactly these blocks, the consumer takes it now."""
        holder = self.pool.session(session_id).holder
        try:
            blocks = self.pool.allocator.unfence(ids)
        except Exception:
            return False
        if took is not None:
            self._take_named(session_id, took, sorted(blocks))
        held = self.pool.allocator.refs_of(holder)
        return all(b in held for b in blocks)

    def _take_named(self, session_id: str, took: Sequence[int], blocks: list[int]) -> None:
        region, nonce, seq = took
        consumer = self.occupants.get(session_id)
        producer = self.at.get(region)
        if consumer is not None and producer is not None and producer.nonce == nonce:
            flight = producer.in_flight.get((seq, consumer.region, consumer.nonce))
            if flight is not None and sorted(flight.blocks) == blocks:
                del producer.in_flight[flight.seq, flight.region, flight.nonce]
                self._deliver(flight, producer)
            return
        unread = self.unread.get(session_id, [])
        for flight in unread:
            if (flight.producer, flight.seq) == (nonce, seq) and sorted(flight.blocks) == blocks:
                unread.remove(flight)
                if not unread:
                    del self.unread[session_id]
                self._deliver(flight, None)
                return

    # -- introspection ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        used = [occupant.region for occupant in self.occupants.values()]
        regions = self.table[used]
        states = regions["slots"]["state"]
        unsettled = (states == HANDED) & (regions["slots"]["seq"] != regions["settled"])
        flights = [f for occupant in self.occupants.values() for f in occupant.in_flight.values()]
        flights += [f for unread in self.unread.values() for f in unread]
        c = self.counters
        return {
            "regions": len(used),
            "regions_free": len(self._free_regions),
            "slab_idle": int(np.count_nonzero(states == IDLE)),
            "slab_allocated": int(np.count_nonzero(states == ALLOCATED)),
            "slab_handed": int(np.count_nonzero(unsettled)),
            "slab_in_flight": sum(len(f.blocks) for f in flights),
            "counters": {name: getattr(c, name) for name in SlabCounters.__slots__},
        }

    def close(self) -> None:
        if not hasattr(self, "table"):
            return
        for occupant in self.occupants.values():
            if occupant.box is not None:
                Path(occupant.box).unlink(missing_ok=True)
        del self.table
        with contextlib.suppress(BufferError):  # a view is still held somewhere: the map goes with it
            self._mm.close()
        self.path.unlink(missing_ok=True)
