"""Handoffs between two live sessions' slabs, with no round trip to the pool on the way.

The producer marks the blocks handed in its region (to the consumer's region and nonce, under its next sequence),
then sends the consumer's lease box one datagram sealed with their pair's key (:mod:`kvpool.slabwire`). The
consumer takes the ids only if the seal holds, the sequence is newer than any it took from that producer (a
replay is dropped), and the producer's region, mapped read-only, says the same: those blocks, handed to this
session under this sequence. If the region says otherwise because the pool already moved the refs (the producer
ended, or reused settled slots), the consumer asks the pool whether it holds them now, and takes them only if so.
The refs move in the pool's books afterwards (the pool settles them: docs/operations.md, "Slabs"); this client has
them settled before it names those blocks in any call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import threading
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool import slabwire
from kvpool.errors import HandoffRefused, InvalidRequest, KvpoolError, UnknownSession
from kvpool.handoffs import Claim
from kvpool.ids import BLOCK_MASK
from kvpool.lease_protocol import PairRequest, PairResponse
from kvpool.leases import ALLOCATED, EMPTY, HANDED, HSEQ, NONCE, PAGE
from kvpool.slab import Slab, as_ids

log = logging.getLogger(__name__)

#: how often a producer tries again to send handoffs a consumer had no room for
FLUSH_S = 0.0005
FLUSH_MAX_S = 0.05
#: how long a producer remembers that a consumer has no lease box before it asks the pool again
NO_BOX_S = 1.0
#: up to this many ids a handoff is checked and marked one id at a time (numpy's per-call cost is a microsecond)
FEW = 128
STATE_MASK = 0xFFFFFFFF


@dataclass(slots=True)
class Peer:
    region: int
    nonce: int
    box: str
    key: Any  # the pair's keyed MAC, ready to copy (slabwire.sealer)
    tag: int = 0  # a handed slot's state word: HANDED | region << 32


class SlabHandoffs:
    def __init__(self, slab: Slab, mode: int) -> None:
        self.slab = slab
        self.transport = slab.transport
        self.peers: dict[str, Peer] = {}
        self.no_box: dict[str, float] = {}
        self.keys: dict[tuple[int, int], Any] = {}  # the pairs' sealers, by (producer region, nonce)
        self.last_seq: dict[tuple[int, int], int] = {}
        self.delivered: OrderedDict[str, Claim] = OrderedDict()
        self.to_settle: set[int] = set()
        self.out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.out.setblocking(False)
        self.queued: deque[tuple[bytes, str]] = deque()
        self.box: socket.socket | None = None
        if slab.info.box is not None:
            box = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            try:
                box.bind(slab.info.box)
                os.chmod(slab.info.box, mode)
                box.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * slabwire.MAX_DATAGRAM)
            except OSError as exc:
                box.close()
                log.warning("no lease box at %s (%s): handoffs to this session go through the pool", slab.info.box, exc)
            else:
                self.box = box
        self._buf = bytearray(slabwire.MAX_DATAGRAM)

    # -- the producer's side ----------------------------------------------------------------------------

    def _peer(self, to: str) -> Peer | None:
        peer = self.peers.get(to)
        view = self.slab.view
        if peer is not None and view.all_words[PAGE // 8 + peer.region * view.region_words + NONCE] == peer.nonce:
            return peer
        if self.no_box.get(to, 0.0) > time.monotonic():
            return None
        try:
            req = PairRequest(session_id=self.slab.session_id, to=to)
            got = self.transport.fetch("POST", "/leases/pair", req, PairResponse)
        except InvalidRequest:  # no such session, or one with no lease box: through the pool
            self.no_box[to] = time.monotonic() + NO_BOX_S
            return None
        assert got.region is not None and got.nonce is not None and got.box is not None
        peer = self.peers[to] = Peer(got.region, got.nonce, got.box, slabwire.sealer(bytes.fromhex(got.key)),
                                     HANDED | got.region << 32)  # fmt: skip
        return peer

    def handoff(self, request_id: str, ids: object, num_tokens: int, meta: bytes, to: str) -> int | None:
        """Hand the slab's allocated blocks ``ids`` to the session called ``to``; how many, or None when this path
        does not apply (not all slab blocks, or no lease box there): then the caller goes through the pool."""
        slab = self.slab
        listed = ids if type(ids) is list else as_ids(ids).tolist()
        n = len(listed)
        if not n or 12 * n + len(meta) + len(request_id) * 4 + 256 > slabwire.MAX_DATAGRAM:
            return None
        with slab.lock:
            slab._answer_want()
            slots = self._allocated_slots(listed) if n <= FEW else self._allocated_array(as_ids(listed))
            if slots is None or (n > 1 and len(set(slots)) != n):
                return None
            peer = self._peer(to)
            if peer is None:
                return None
            words = slab.view.words
            seq = words[HSEQ] + 1
            words[HSEQ] = seq
            self._mark(slots, seq, peer)
            slab.handed += n
            info = slab.info
            packed = (array("i", slots).tobytes(), array("q", listed).tobytes())
            datagram = slabwire.encode(peer.key, info.region, info.nonce, seq, request_id, num_tokens, meta, *packed)
            # under the lock: datagrams leave in sequence order, or the consumer would drop one as a replay
            if self.queued:
                self.queued.append((datagram, peer.box))
                return n
            try:
                self.out.sendto(datagram, peer.box)
            except BlockingIOError:  # the consumer's queue is full (a few datagrams): send it later, never wait
                self.queued.append((datagram, peer.box))
                threading.Thread(target=self._flush, name="kvpool-slab-send", daemon=True).start()
            except OSError as exc:
                self.peers.pop(to, None)
                kept = self._take_back(slots, seq, peer.tag)
                if kept is None:
                    why = "its blocks are handed already: they go to that session if it is still there, else back to " \
                          "the pool"
                elif len(kept) == n:
                    why = "nothing was handed: the blocks are still yours"
                else:
                    why = (f"the pool had settled {n - len(kept)} of its blocks already (they go to that session if it "
                           f"is still there, else back to the pool); these are still yours: {kept}")
                err = HandoffRefused(f"the handoff of {request_id!r} could not reach {to!r} ({exc}); {why}")
                err.kept = tuple(kept or ())  # the ids still the caller's
                raise err from None
        return n

    def _take_back(self, slots: list[int], seq: int, tag: int) -> list[int] | None:
        """After a datagram that could not leave: the ids of the blocks that are allocated here again, or None if the
        pool could not be asked. Each slot's state goes back first; then one round trip to the pool (a settle of
        this region), after which any settle of the pool's that saw them handed is over, and ``settled`` says which
        it moved."""
        slab = self.slab
        words = slab.view.words
        for slot in slots:
            words[9 + 4 * slot] = ALLOCATED
        try:
            slab.settle([slab.info.region])
        except KvpoolError:
            for slot in slots:
                words[9 + 4 * slot] = tag  # handed, as they were: the pool settles them
            return None
        kept = []
        for slot in slots:
            if slab.settled[slot] == seq:
                words[9 + 4 * slot] = EMPTY
                slab.empty.append(slot)
            else:
                fid = words[8 + 4 * slot]
                slab.slot_at[fid & BLOCK_MASK] = slot
                kept.append(fid)
        slab.handed -= len(slots)
        return kept

    def _allocated_slots(self, ids: list[int]) -> list[int] | None:
        """The slots of these ids if each names an allocated block of this slab at its generation, else None."""
        slot_at, words, n = self.slab.slot_at, self.slab.view.words, len(self.slab.slot_at)
        slots = []
        for fid in ids:
            block = fid & BLOCK_MASK
            slot = slot_at[block] if block < n and fid >= 0 else -1
            if slot < 0 or words[8 + 4 * slot] != fid or words[9 + 4 * slot] & STATE_MASK != ALLOCATED:
                return None
            slots.append(slot)
        return slots

    def _allocated_array(self, arr: np.ndarray) -> list[int] | None:
        """The same for many ids at once (an id that is no allocated block of this slab fails one of the two
        comparisons: a block not in the slab maps to slot -1, whose block field never holds such an id)."""
        slab = self.slab
        slots = slab.slot_of.take(arr & BLOCK_MASK, mode="clip")
        if not ((slab.state[slots] == ALLOCATED).all() and (slab.block[slots] == arr).all()):
            return None
        return slots.tolist()

    def _mark(self, slots: list[int], seq: int, peer: Peer) -> None:
        """Mark the slots handed to ``peer`` under ``seq`` (each slot's other fields first, its state last: readers
        read the state first), and forget their blocks here."""
        slab = self.slab
        words, slot_at, tag, nonce = slab.view.words, slab.slot_at, peer.tag, peer.nonce
        if len(slots) <= FEW:
            for slot in slots:
                at = 8 + 4 * slot
                words[at + 2] = seq
                words[at + 3] = nonce
                words[at + 1] = tag
                slot_at[words[at] & BLOCK_MASK] = -1
            return
        at = np.asarray(slots)
        slab.words[at, 2:] = (seq, nonce)
        slab.words[at, 1] = tag
        slab.slot_of[slab.block[at] & BLOCK_MASK] = -1

    def _flush(self) -> None:
        """Send the queued datagrams in order as their consumers make room; one whose consumer is gone is dropped
        (the pool gives its blocks back when it settles)."""
        pause = FLUSH_S
        while True:
            with self.slab.lock:
                if not self.queued or self.out.fileno() < 0:
                    self.queued.clear()
                    return
                datagram, box = self.queued[0]
                try:
                    self.out.sendto(datagram, box)
                except BlockingIOError:
                    pause = min(2 * pause, FLUSH_MAX_S)  # a consumer that does not read: no busy loop meanwhile
                except OSError as exc:
                    log.warning("dropped a slab handoff to %s: %s", box, exc)
                    self.queued.popleft()
                else:
                    self.queued.popleft()
                    pause = FLUSH_S
                    continue
            time.sleep(pause)

    # -- the consumer's side ----------------------------------------------------------------------------

    def receive(self, request_id: str | None, spin_s: float, wait_s: float) -> Claim | None:
        """A handoff from a slab (``request_id``'s, or the oldest), spinning ``spin_s`` and then blocking up to
        ``wait_s`` in all; None if none came."""
        if self.box is None:
            return None
        start = time.perf_counter()
        spin_until, until = start + min(spin_s, wait_s), start + wait_s
        while True:
            got = self.delivered.pop(request_id, None) if request_id is not None else None
            if got is None and request_id is None and self.delivered:
                got = self.delivered.popitem(last=False)[1]
            if got is not None:
                return got
            try:
                n = self.box.recv_into(self._buf, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                now = time.perf_counter()
                if now >= until:
                    return None
                if now >= spin_until:
                    select.select([self.box], [], [], until - now)
                continue
            claim = self._take(memoryview(self._buf)[:n])
            if claim is not None:
                self.delivered[claim.request_id] = claim

    def _take(self, data: memoryview) -> Claim | None:
        pair = slabwire.peek(data)
        if pair is None:
            return None
        key = self.keys.get(pair)
        if key is None:
            try:
                req = PairRequest(session_id=self.slab.session_id, from_region=pair[0], from_nonce=pair[1])
                got = self.transport.fetch("POST", "/leases/pair", req, PairResponse)
                key = self.keys[pair] = slabwire.sealer(bytes.fromhex(got.key))
            except (UnknownSession, InvalidRequest) as exc:
                log.debug("dropped a slab handoff from region %d: %s", pair[0], exc)
                return None
        h = slabwire.decode(data, key)
        if h is None:
            log.warning("dropped a slab handoff whose seal is not its pair's")
            return None
        if h.seq <= self.last_seq.get(pair, 0):
            log.warning("dropped a replayed slab handoff (%r, sequence %d)", h.request_id, h.seq)
            return None
        if self._vouched(h):
            self.to_settle.add(h.from_region)
        elif not self._held(h):
            log.warning("dropped slab handoff %r: neither its producer's region nor the pool vouch", h.request_id)
            return None
        self.last_seq[pair] = h.seq
        return Claim(h.request_id, h.num_tokens, h.meta, h.packed, direct=True)

    def _vouched(self, h: slabwire.SlabHandoff) -> bool:
        """Whether the producer's region says these blocks are handed to this session under this sequence: each slot
        must read (id, handed | this region, this sequence, this nonce), word for word."""
        view, info, n = self.slab.view, self.slab.info, len(h.slots)
        if not n or not 0 <= h.from_region < view.regions:
            return False
        words, base = view.all_words, PAGE // 8 + h.from_region * view.region_words
        if words[base + NONCE] != h.from_nonce:
            return False
        tag, seq, nonce, capacity = HANDED | info.region << 32, h.seq, info.nonce, self.slab.capacity
        if n <= FEW:
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

    def _held(self, h: slabwire.SlabHandoff) -> bool:
        try:
            return self.slab.settle([h.from_region], h.packed.tolist())
        except KvpoolError:
            return False

    def settle(self) -> None:
        """Before this session names blocks it was handed: have the pool move their refs to it."""
        if self.to_settle:
            regions = list(self.to_settle)
            self.slab.settle(regions)
            self.to_settle.difference_update(regions)

    def close(self) -> None:
        self.out.close()
        if self.box is not None:
            self.box.close()
            with contextlib.suppress(OSError):
                os.unlink(self.slab.info.box or "")


