"""Handoffs from another live session's slab to this one's, the consumer's side: its slab box and its producers'
rings.

Past 400 lines on purpose: the slab box and the producers' rings are one consumer's receive path, with one settle
and one set of pair keys.

A producer marks the blocks it hands in its region of the slab table and tells this session (:mod:`kvpool.slab.send`).
Its first handoff here comes as one datagram to this session's box, sealed with their pair's key
(:mod:`kvpool.slab.wire`): this side takes the ids only if the seal holds, the sequence is newer than any it took from
that producer (a replay is dropped), and the producer's region, mapped read-only, says the same: those blocks,
handed to this session under this sequence (a run of consecutive slots is compared a column at a time). From then
on this session *watches* that producer (its ``watch`` word names the producer's nonce): the producer writes its
next handoffs here into its ring and rings this session's bell in its region, and a claim reads the bell and the
entry straight from the table, with no system call, then checks the slots the same way. The region is the
producer's own to write (the pool vouches which session occupies it), so the seal adds nothing there; a replay
cannot happen, since the entry is read where it lies, above the last sequence taken. If the region says otherwise
because the pool already took the blocks out of the producer's slab (the producer reused settled slots, or ended),
it asks the pool whether it holds them now, naming the handoff, and takes them only if so.

The refs move in the pool's books afterwards (the pool settles them: docs/operations.md, "Slabs"), and only to a
consumer that took the handoff: it notes each one it took in its ``took`` word for that producer, and then reads
whether the producer is still there (a fence between), while the pool, when a producer ends, first clears its nonce
and then reads ``took``. So either the pool sees the take and gives this session the blocks, or this side sees the
producer gone and asks the pool, which parked for it what it had not taken from the producer's ring. This client
has the refs settled before it names those blocks in any call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import socket
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.errors import InvalidRequest, KvpoolError, UnknownSession
from kvpool.handoffs import Claim
from kvpool.slab import wire
from kvpool.slab.protocol import SLAB_PAIR, PairRequest
from kvpool.slab.reservation import Slab
from kvpool.slab.table import ENTRY, ENTRY_HEAD, ENTRY_ROOM, HANDED, NONCE, RING, WAITING, column, fence

log = logging.getLogger(__name__)

#: up to this many ids the producer's slots are checked one at a time (numpy's per-call cost is a microsecond)
FEW = 128
#: while it watches rings, a spinning claim looks at its box once in this many turns
LOOKS = 4
#: the most datagrams one drain of the box takes: more than its receive buffer (4 of the largest) holds of the
#: smallest, so that only a peer that keeps sending meanwhile is cut short
DRAIN_MAX = 1024


@dataclass(slots=True)
class Watched:
    """A producer whose ring this session reads."""

    region: int
    nonce: int
    base: int  # where its region starts in the table's words
    bell: int  # the table's word of its bell for this session
    ring: int  # where its ring starts in the table, in bytes
    last: int  # the last sequence taken from it


class SlabBox:
    def __init__(self, slab: Slab, mode: int) -> None:
        self.slab = slab
        self.transport = slab.transport
        self.keys: dict[tuple[int, int], Any] = {}  # the pairs' sealers, by (producer region, nonce)
        self.last_seq: dict[tuple[int, int], int] = {}
        self.delivered: OrderedDict[str, Claim] = OrderedDict()
        self.watching: list[Watched] = []  # the producers whose rings a claim reads, and the same by pair
        self.watched: dict[tuple[int, int], Watched] = {}
        self.to_settle: set[int] = set()
        self.sock: socket.socket | None = None
        self._poll = select.poll()
        if slab.info.box is not None:
            box = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                box.bind(slab.info.box)
                os.chmod(slab.info.box, mode)
                box.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * wire.MAX_DATAGRAM)
            except OSError as exc:
                box.close()
                log.warning("no slab box at %s (%s): handoffs to this session go through the pool", slab.info.box, exc)
            else:
                self.sock = box
                self._poll.register(box, select.POLLIN)
        self._buf = bytearray(wire.MAX_DATAGRAM)
        capacity = slab.capacity
        self._tags = column("Q", HANDED | slab.info.region << 32, capacity)  # a slot handed to this session
        self._nonces = column("Q", slab.info.nonce, capacity)

    def receive(self, request_id: str | None, spin_s: float, wait_s: float) -> Claim | None:
        """A handoff from a slab (``request_id``'s, or the oldest), spinning ``spin_s`` and then blocking up to
        ``wait_s`` in all; None if none came."""
        if self.sock is None:
            return None
        start = time.perf_counter()
        spin_until, until = start + min(spin_s, wait_s), start + wait_s
        everyone, watching, delivered, poll = self.slab.view.all_words, self.watching, self.delivered, self._poll.poll
        spins = 0
        while True:
            got = None
            if delivered:
                got = delivered.pop(request_id, None) if request_id is not None else delivered.popitem(last=False)[1]
                if got is not None:
                    return got
            for watched in watching:
                seq = everyone[watched.bell]
                if seq > watched.last:
                    got = self._next(watched, seq)
                    if got is None:
                        got = self._rung(watched, request_id)
                    elif request_id is not None and got.request_id != request_id:
                        delivered[got.request_id], got = got, None
                    break
            if got is not None:
                return got
            spins += 1
            # a ring costs a read, the box a system call: look at the box once in LOOKS turns
            if watching and spins % LOOKS and time.perf_counter() < spin_until:
                continue
            if not poll(0):  # no exception to raise and catch, as an empty receive would (a microsecond)
                now = time.perf_counter()
                if now >= until:
                    return None
                if now >= spin_until:
                    self._sleep(until - now)
                continue
            try:
                claim = self._receive_one()
            except BlockingIOError:
                continue
            if claim is not None:
                if request_id is None or claim.request_id == request_id:
                    return claim
                delivered[claim.request_id] = claim
            if time.perf_counter() >= until:  # a box that never runs dry (datagrams for other requests, or that
                return None  # carry nothing) must not hold a claim past its time

    def _sleep(self, wait_s: float) -> None:
        """Block on the box, saying so first: a producer that rings a bell meanwhile sends a wake-up."""
        words, everyone = self.slab.view.words, self.slab.view.all_words
        words[WAITING] = 1
        fence()
        try:
            if not any(everyone[w.bell] > w.last for w in self.watching):
                select.select([self.sock], [], [], wait_s)
        finally:
            words[WAITING] = 0

    def _next(self, watched: Watched, seq: int) -> Claim | None:
        """The common case in one frame: the bell names the one entry not taken yet, after no datagram, a run of
        slots its producer's region vouches for. None for anything else (nothing taken): :meth:`_rung` then."""
        at = watched.ring + seq % RING * ENTRY
        got, prev, datagram, nonce, num_tokens, region, n, run, rid_len, meta_len = ENTRY_HEAD.unpack_from(
            self.slab.view.ro, at
        )
        last, info = watched.last, self.slab.info
        if got != seq or prev > last or datagram > last or region != info.region or nonce != info.nonce or run < 0:
            return None
        payload = self._payload(at, n, 0, rid_len, meta_len)
        if payload is None or not self._run_vouched(watched.base, run, seq, payload[0]):
            return None
        everyone = self.slab.view.all_words
        if everyone[watched.base + NONCE] != watched.nonce:
            return None
        self._took(watched, (watched.region, watched.nonce), seq)
        fence()  # then whether the producer is still there (see SlabBooks.release): if so, the pool sees the took
        if everyone[watched.base + NONCE] != watched.nonce:
            h = wire.SlabHandoff(watched.region, watched.nonce, seq, payload[2], num_tokens, payload[3], payload[1],
                                     payload[0], run)  # fmt: skip
            return self._claim(h) if self._held(h) else self._left(h)
        self.to_settle.add(watched.region)
        return Claim(payload[2], num_tokens, payload[3], payload[0], None, True)

    def _payload(
        self, at: int, n: int, listed: int, rid_len: int, meta_len: int
    ) -> tuple[array, array, str, dict[str, Any]] | None:
        """The ids, slots (``listed`` bytes of them), request id and meta of the ring entry at ``at``; None if they do
        not fit an entry or do not decode."""
        if not n or 8 * n + listed + rid_len + meta_len > ENTRY_ROOM:
            return None
        ro = self.slab.view.ro
        at += ENTRY_HEAD.size
        packed, slots = array("q"), array("i")
        packed.frombytes(ro[at : at + 8 * n])
        at += 8 * n
        slots.frombytes(ro[at : at + listed])
        at += listed
        try:
            request_id = str(ro[at : at + rid_len], "utf-8")
            meta = json.loads(ro[at + rid_len : at + rid_len + meta_len]) if meta_len else {}
        except (ValueError, RecursionError):
            return None
        return packed, slots, request_id, meta if type(meta) is dict else {}

    def _rung(self, watched: Watched, request_id: str | None) -> Claim | None:
        """Take the handoffs in ``watched``'s ring: the one for ``request_id`` (or the oldest) back, any other into
        ``delivered``."""
        got = None
        for claim in self._from_ring(watched):
            if got is None and (request_id is None or claim.request_id == request_id):
                got = claim
            else:
                self.delivered[claim.request_id] = claim
        return got

    def _from_ring(self, watched: Watched, below: int = 0) -> list[Claim]:
        """The handoffs in a watched producer's ring not taken yet (those below sequence ``below`` only, if given),
        oldest first. A datagram the producer sent before them is taken first (it is in the box already)."""
        view, info = self.slab.view, self.slab.info
        everyone, ro = view.all_words, view.ro
        if everyone[watched.base + NONCE] != watched.nonce:  # the producer's session ended
            self._unwatch(watched)
            return []
        entries = []
        seq = top = everyone[watched.bell]
        # The producer writes the bell, the entries and their links: each link must go down, and no further back
        # than the ring reaches, so the walk ends within RING steps whatever the region says.
        while seq > watched.last:
            at = watched.ring + seq % RING * ENTRY
            fields = ENTRY_HEAD.unpack_from(ro, at)
            if fields[0] != seq or fields[5] != info.region or fields[3] != info.nonce or seq + RING <= top:
                log.warning("dropped slab handoffs from region %d: its ring does not hold sequence %d for this "
                            "session", watched.region, seq)  # fmt: skip
                break
            if not below or seq < below:
                entries.append((fields, at))
            if fields[1] >= seq:
                log.warning("dropped slab handoffs from region %d: its ring's entry %d links to %d, not to an older "
                            "one", watched.region, seq, fields[1])  # fmt: skip
                break
            seq = fields[1]
        if entries and not below and entries[0][0][2] > watched.last:
            self._drain()
        claims = []
        for fields, at in reversed(entries):
            if fields[0] > watched.last:
                claim = self._entry(watched, fields, at)
                if claim is not None:
                    claims.append(claim)
        if not below and watched.last < top:  # past what could not be read, or the bell would ring for it forever
            self._took(watched, (watched.region, watched.nonce), top)
        return claims

    def _entry(self, watched: Watched, fields: tuple[int, ...], at: int) -> Claim | None:
        """The handoff of one ring entry, if the producer's slots vouch for it (or the pool holds its blocks); its
        sequence is taken either way (copied first: once taken, the entry's place is the producer's again)."""
        seq, _, _, _, num_tokens, _, n, run, rid_len, meta_len = fields
        payload = None if run > self.slab.capacity - n else self._payload(at, n, 4 * n if run < 0 else 0, rid_len,
                                                                          meta_len)  # fmt: skip
        if payload is None:
            self._took(watched, (watched.region, watched.nonce), seq)
            return None
        packed, slots, request_id, meta = payload
        h = wire.SlabHandoff(watched.region, watched.nonce, seq, request_id, num_tokens, meta, slots, packed, run)
        claim = self._accept(h, watched)
        if claim is None:
            self._took(watched, (watched.region, watched.nonce), seq)
            if self.slab.view.all_words[watched.base + NONCE] != watched.nonce:
                return self._left(h)
            log.warning("dropped slab handoff %r: neither its producer's region nor the pool vouch", h.request_id)
        return claim

    def _receive_one(self) -> Claim | None:
        """The handoff in the box's next datagram (None if it held none); BlockingIOError if the box is empty."""
        assert self.sock is not None
        n = self.sock.recv_into(self._buf, 0, socket.MSG_DONTWAIT)
        return self._take(memoryview(self._buf)[:n])

    def _drain(self) -> None:
        """Take the datagrams waiting in the box, into ``delivered`` (as many as the box can hold: a peer that keeps
        sending cannot keep this going)."""
        for _ in range(DRAIN_MAX):
            try:
                claim = self._receive_one()
            except BlockingIOError:
                return
            if claim is not None:
                self.delivered[claim.request_id] = claim

    def _take(self, data: memoryview) -> Claim | None:
        fields = wire.head(data)
        if fields is None:
            return None
        pair = fields[1], fields[3]
        key = self.keys.get(pair)
        if key is None:
            try:
                req = PairRequest(session_id=self.slab.session_id, from_region=pair[0], from_nonce=pair[1])
                got = self.transport.fetch(SLAB_PAIR, req)
                key = self.keys[pair] = wire.sealer(bytes.fromhex(got.key))
            except (UnknownSession, InvalidRequest) as exc:
                log.debug("dropped a slab handoff from region %d: %s", pair[0], exc)
                return None
        h = wire.decode(data, key, fields)
        if h is None:
            log.warning("dropped a slab handoff whose seal is not its pair's")
            return None
        watched = self.watched.get(pair)
        if watched is not None and self.slab.view.all_words[watched.bell] > watched.last:
            for claim in self._from_ring(watched, below=h.seq):  # its ring's handoffs older than this one first
                self.delivered[claim.request_id] = claim
        if h.seq <= self.last_seq.get(pair, 0):
            log.warning("dropped a replayed slab handoff (%r, sequence %d)", h.request_id, h.seq)
            return None
        claim = self._accept(h, watched)  # one it drops does not take the sequence from the true one on its way
        if claim is None:
            log.warning("dropped slab handoff %r: neither its producer's region nor the pool vouch", h.request_id)
        return claim

    def _accept(self, h: wire.SlabHandoff, watched: Watched | None) -> Claim | None:
        """The claim of a handoff its producer's region vouches for, or that the pool holds for this session (taking
        it if it is in flight here); None if neither. Either way the sequence is taken once the handoff is: in the
        region's ``took`` word for its producer, which the pool reads (watching the producer from its first)."""
        pair = h.from_region, h.from_nonce
        if self._vouched(h):
            if watched is None:
                watched = self._watch(*pair, h.seq)
            self._took(watched, pair, h.seq)
            fence()  # then whether the producer is still there (see SlabBooks.release): if so, the pool sees the took
            if self.slab.view.all_words[watched.base + NONCE] == h.from_nonce:
                self.to_settle.add(h.from_region)
                return self._claim(h)
        if not self._held(h):
            return None
        if watched is None and self.slab.view.all_words[self.slab.view.base(h.from_region) + NONCE] == h.from_nonce:
            watched = self._watch(*pair, h.seq)  # a live producer's first: read its ring from now on
        self._took(watched, pair, h.seq)
        return self._claim(h)

    @staticmethod
    def _claim(h: wire.SlabHandoff) -> Claim:
        return Claim(h.request_id, h.num_tokens, h.meta, h.packed, None, True)

    def _left(self, h: wire.SlabHandoff) -> None:
        """A ring's handoff whose producer ended before this session took it: the pool parked it for this session,
        where a claim finds it."""
        log.info("slab handoff %r: its producer ended before this session took it; the pool holds it here",
                 h.request_id)  # fmt: skip

    def _took(self, watched: Watched | None, pair: tuple[int, int], seq: int) -> None:
        """Nothing from this producer at or below ``seq`` is taken again; the producer may reuse its ring entries."""
        self.last_seq[pair] = seq
        if watched is not None:
            self.slab.ensure_mine()  # a region the pool took back may be another session's by now
            watched.last = seq
            self.slab.view.words[self.slab.view.took + watched.region] = seq

    def _watch(self, region: int, nonce: int, seq: int) -> Watched:
        """Read this producer's ring from now on, and say so in this session's region (took first, then watch: a
        producer that sees the watch sees the took with it)."""
        view = self.slab.view
        self.slab.ensure_mine()
        for old in [w for w in self.watching if w.region == region]:
            self._unwatch(old)
        view.words[view.took + region] = seq
        view.words[view.watch + region] = nonce
        base = view.base(region)
        watched = Watched(region, nonce, base, base + view.bells + self.slab.info.region, 8 * base + view.ring, seq)
        self.watching.append(watched)
        self.watched[region, nonce] = watched
        return watched

    def _unwatch(self, watched: Watched) -> None:
        view = self.slab.view
        self.watching.remove(watched)
        del self.watched[watched.region, watched.nonce]
        if view.words[NONCE] == self.slab.info.nonce:  # still this session's region
            view.words[view.watch + watched.region] = 0

    def _vouched(self, h: wire.SlabHandoff) -> bool:
        """Whether the producer's region says these blocks are handed to this session under this sequence: each slot
        must read (id, handed | this region, this sequence, this nonce), word for word."""
        view, info, n = self.slab.view, self.slab.info, len(h.packed)
        if not n or not 0 <= h.from_region < view.regions:
            return False
        words, base = view.all_words, view.base(h.from_region)
        if words[base + NONCE] != h.from_nonce:
            return False
        tag, seq, nonce, capacity = HANDED | info.region << 32, h.seq, info.nonce, self.slab.capacity
        if h.run >= 0:
            if not self._run_vouched(base, h.run, seq, h.packed):
                return False
        elif n <= FEW:
            for slot, fid in zip(h.slots, h.packed, strict=True):
                at = base + 8 + 4 * slot
                if not 0 <= slot < capacity or words[at] != fid or words[at + 1] != tag:
                    return False
                if words[at + 2] != seq or words[at + 3] != nonce:
                    return False
        else:
            slots = np.frombuffer(h.slots, np.int32)
            if slots.min() < 0 or slots.max() >= capacity:
                return False
            got = view.table[h.from_region]["slots"][slots]
            want = np.empty((n, 4), "<u8")
            want[:, 0] = np.frombuffer(h.packed, np.int64)
            want[:, 1:] = (tag, seq, nonce)
            if got.tobytes() != want.tobytes():
                return False
        return words[base + NONCE] == h.from_nonce

    def _run_vouched(self, base: int, run: int, seq: int, packed: array) -> bool:
        """Whether the region at ``base`` holds ``packed`` in the slots from ``run`` on, each handed to this session
        under ``seq``: a column at a time."""
        n, words = len(packed), self.slab.view.all_words
        if not 0 <= run <= self.slab.capacity - n:
            return False
        at = base + 8 + 4 * run
        end = at + 4 * n
        if words[at + 1 : end : 4] != self._tags[:n] or words[at:end:4] != memoryview(packed).cast("B").cast("Q"):
            return False
        return words[at + 2 : end : 4] == column("Q", seq, n) and words[at + 3 : end : 4] == self._nonces[:n]

    def _held(self, h: wire.SlabHandoff) -> bool:
        """Whether the pool says this session holds the handoff's blocks, taking them first if they are in flight
        to it (the producer's slots were settled and reused meanwhile, or the producer ended)."""
        try:
            return self.slab.settle([h.from_region], h.packed.tolist(), (h.from_region, h.from_nonce, h.seq))
        except KvpoolError:
            return False

    def settle(self) -> None:
        """Before this session names blocks it was handed: have the pool move their refs to it."""
        if self.to_settle:
            regions = list(self.to_settle)
            self.slab.settle(regions)
            self.to_settle.difference_update(regions)

    def close(self) -> None:
        for watched in list(self.watching):  # producers send datagrams again, which a closed box refuses
            self._unwatch(watched)
        if self.sock is not None:
            self.sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.slab.info.box or "")
