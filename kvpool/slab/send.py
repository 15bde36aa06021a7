"""Handoffs from this session's slab to another live session's, the producer's side: no round trip to the pool.

The producer checks that the ids name blocks its slab holds allocated at their generations, marks them handed in
its region of the slab table (to the consumer's region and nonce, under its next sequence: each slot's other
words first, its state last), and tells the consumer. The first time, and whenever the consumer does not read its
ring, that is one datagram to the consumer's slab box sealed with their pair's key (:mod:`kvpool.slab.wire`). Once
the consumer has taken a handoff from it, the consumer watches this producer's region: the producer then writes the
handoff into its ring and rings the consumer's bell there, with no system call (a wake-up datagram only if the
consumer sleeps); the consumer's side is :mod:`kvpool.slab.box`. The blocks of one alloc sit in consecutive slots,
so a handoff of them is checked, marked and sent as a run: one comparison or write per column of the run, where
other ids take one per slot. If a datagram cannot leave, the slots are taken back before the pool settles them,
and the refusal says which ids are still the caller's. Each datagram that did leave is noted in the consumer's
``sent`` word of this region: if this session ends before the consumer took it, the pool knows it waits in the
consumer's box (and frees the blocks of one that never left).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.errors import HandoffRefused, InvalidRequest, KvpoolError
from kvpool.ids import BLOCK_MASK
from kvpool.slab import wire
from kvpool.slab.protocol import SLAB_PAIR, PairRequest
from kvpool.slab.reservation import Slab, as_ids
from kvpool.slab.table import (
    ALLOCATED,
    EMPTY,
    ENTRY,
    ENTRY_HEAD,
    ENTRY_ROOM,
    HANDED,
    HSEQ,
    NONCE,
    RING,
    WAITING,
    column,
    fence,
)

log = logging.getLogger(__name__)

#: how often a producer tries again to send handoffs a consumer had no room for
FLUSH_S = 0.0005
FLUSH_MAX_S = 0.05
#: how long a producer remembers that a consumer has no slab box before it asks the pool again
NO_BOX_S = 1.0
#: up to this many ids a handoff is checked and marked one id at a time (numpy's per-call cost is a microsecond)
FEW = 128
STATE_MASK = 0xFFFFFFFF


@dataclass(slots=True)
class Peer:
    region: int
    nonce: int
    box: str
    sock: socket.socket  # connected to the box: a send skips the kernel's lookup of its path (a microsecond)
    key: Any  # the pair's keyed MAC, ready to copy (wire.sealer)
    tag: int  # a handed slot's state word: HANDED | region << 32
    tags: memoryview  # the tag and the nonce over a whole slab's slots, to mark a run of them in one write each
    nonces: memoryview
    watch: int  # in the table's words: the consumer's watch and took of this producer, its waiting word
    took: int
    waiting: int
    bell: int  # in this region's words: the bell this producer rings for the consumer, and its sent word
    sent: int
    at_nonce: int  # in the table's words: the consumer region's nonce
    last_ring: int = 0  # the sequence of the last handoff to it through the ring, and through a datagram
    last_datagram: int = 0


class SlabSender:
    def __init__(self, slab: Slab) -> None:
        self.slab = slab
        self.transport = slab.transport
        self.peers: dict[str, Peer] = {}
        self.no_box: dict[str, float] = {}
        self.queued: deque[tuple[bytes, Peer, int]] = deque()  # datagrams waiting to leave, with their sequences
        self.closed = False
        self._allocated_row = column("I", ALLOCATED, slab.capacity)
        self.use_ring = slab.config.ring  # False: every handoff goes as a datagram
        self._free = 0  # a sequence whose entry's place in the ring is known to be free

    def _peer(self, to: str) -> Peer | None:
        peer = self.peers.get(to)
        view = self.slab.view
        if peer is not None and view.all_words[peer.at_nonce] == peer.nonce:
            return peer
        if self.no_box.get(to, 0.0) > time.monotonic():
            return None
        try:
            req = PairRequest(session_id=self.slab.session_id, to=to)
            got = self.transport.fetch(SLAB_PAIR, req)
        except InvalidRequest:  # no such session, or one with no slab box: through the pool
            self.no_box[to] = time.monotonic() + NO_BOX_S
            return None
        assert got.region is not None and got.nonce is not None and got.box is not None
        self._drop(to)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setblocking(False)
            sock.connect(got.box)
        except OSError as exc:
            sock.close()
            log.debug("no slab box to send to at %s (%s): handoffs to %s go through the pool", got.box, exc, to)
            self.no_box[to] = time.monotonic() + NO_BOX_S
            return None
        tag, capacity, me = HANDED | got.region << 32, self.slab.capacity, self.slab.info.region
        base = view.base(got.region)
        peer = self.peers[to] = Peer(got.region, got.nonce, got.box, sock, wire.sealer(bytes.fromhex(got.key)),
                                     tag, column("Q", tag, capacity), column("Q", got.nonce, capacity),
                                     base + view.watch + me, base + view.took + me, base + WAITING,
                                     view.bells + got.region, view.sent + got.region, base + NONCE)  # fmt: skip
        return peer

    def _drop(self, to: str) -> None:
        """Forget a peer; datagrams still queued for it are dropped when their turn comes."""
        peer = self.peers.pop(to, None)
        if peer is not None:
            peer.sock.close()

    def send(self, request_id: str, ids: object, num_tokens: int, meta: bytes, to: str) -> int | None:
        """Hand the slab's allocated blocks ``ids`` to the session called ``to``; how many, or None when this path
        does not apply (not all slab blocks, or no slab box there): then the caller goes through the pool."""
        slab = self.slab
        listed = ids if type(ids) is list else as_ids(ids).tolist()
        n = len(listed)
        if not n or 12 * n + len(meta) + len(request_id) * 4 + 256 > wire.MAX_DATAGRAM:
            return None
        with slab.lock:
            slab._answer_want()
            try:
                packed = array("Q", listed)  # unsigned, as the slots' block words: a negative id is no block of ours
            except (OverflowError, TypeError):
                return None
            run = self._allocated_run(listed, packed)
            slots = range(run, run + n) if run >= 0 else self._allocated_listed(listed)
            if slots is None or (slab._leaving and not slab._leaving.isdisjoint(slots)):  # through the pool, which
                return None  # refuses a block a call on its way gives up
            peer = self._peer(to)
            if peer is None:
                return None
            words = slab.view.words
            seq = words[HSEQ] + 1
            words[HSEQ] = seq
            if run >= 0:
                self._mark_run(run, n, seq, peer)
            else:
                self._mark(slots, seq, peer)
            info = slab.info
            listed_slots = b"" if run >= 0 else array("i", slots).tobytes()
            id_bytes, failed = packed.tobytes(), None
            if not self._ring(peer, seq, request_id, num_tokens, meta, id_bytes + listed_slots, run, n):
                datagram = wire.encode(peer.key, info.region, info.nonce, seq, request_id, num_tokens, meta,
                                           listed_slots, id_bytes, run)  # fmt: skip
                failed = self._send(datagram, peer, seq)
                peer.last_datagram = seq
            slab.handed += n
            self._forget(listed)  # the slab's own map, after the bell or the datagram: off the consumer's path
            if failed is not None:
                self._drop(to)
                raise self._unsent(request_id, to, failed, slots, seq, peer.tag) from None
        return n

    def _allocated_run(self, ids: list[int], packed: array) -> int:
        """The first slot if these ids sit allocated, at their generations, in consecutive slots from there (as a
        slab hands out its blocks): then one comparison of each column checks them all; else -1."""
        slab, n = self.slab, len(ids)
        block = ids[0] & BLOCK_MASK
        first = slab.slot_at[block] if block < len(slab.slot_at) else -1
        if first < 0 or first + n > slab.capacity:
            return -1
        at = 8 + 4 * first
        end = at + 4 * n
        if slab.view.words[at:end:4] != packed or slab.view.halves[2 * at + 2 : 2 * end : 8] != self._allocated_row[:n]:
            return -1
        return first

    def _allocated_listed(self, ids: list[int]) -> list[int] | None:
        """The slots of ids in any order, checked one by one (numpy past ``FEW``), if each names a distinct
        allocated block of this slab at its generation; else None."""
        n = len(ids)
        slots = self._allocated_slots(ids) if n <= FEW else self._allocated_array(as_ids(ids))
        if slots is None or (n > 1 and len(set(slots)) != n):
            return None
        return slots

    def _ring(
        self, peer: Peer, seq: int, request_id: str, num_tokens: int, meta: bytes, ids: bytes, run: int, n: int
    ) -> bool:
        """Write the handoff (``ids``: the ids, then the slots unless a run) into this region's ring and ring the
        consumer's bell, if the consumer watches this producer, the entry's place is free (its consumer took it, or
        is gone) and it fits; False to send it as a datagram instead (then also while earlier datagrams wait to
        leave, which must arrive first)."""
        view, info = self.slab.view, self.slab.info
        everyone = view.all_words
        if everyone[peer.watch] != info.nonce or self.queued or not self.use_ring:
            return False
        rid = request_id.encode()
        size = len(ids) + len(rid) + len(meta)
        at = view.ring + seq % RING * ENTRY
        if size > ENTRY_ROOM or (seq != self._free and not self._taken(at // 8, view.words[at // 8])):
            return False
        rw = view.rw
        ENTRY_HEAD.pack_into(rw, at, seq, peer.last_ring, peer.last_datagram, peer.nonce, num_tokens, peer.region, n,
                             run, len(rid), len(meta))  # fmt: skip
        at += ENTRY_HEAD.size
        rw[at : at + size] = ids + rid + meta
        view.words[peer.bell] = seq
        peer.last_ring = seq
        fence()
        if everyone[peer.waiting]:
            with contextlib.suppress(OSError):  # a full box wakes it anyway; a closed one is a consumer that left
                peer.sock.send(b"\0")  # it sleeps on its box: wake it (it reads the ring, not this)
        at = view.ring + (seq + 1) % RING * ENTRY  # the next entry's place, looked at now, off the consumer's path
        if self._taken(at // 8, view.words[at // 8]):
            self._free = seq + 1  # once free, it stays so: only this session writes its ring
        return True

    def _taken(self, word: int, seq: int) -> bool:
        """Whether the ring entry at ``word`` (of sequence ``seq``, 0: never written) is done with: its consumer
        took it, or left."""
        if not seq:
            return True
        view, info = self.slab.view, self.slab.info
        words, everyone = view.words, view.all_words
        region, nonce = words[word + 5] & STATE_MASK, words[word + 3]
        if region >= view.regions:
            return True
        base = view.base(region)
        if everyone[base + NONCE] != nonce:
            return True
        me = info.region
        return everyone[base + view.watch + me] == info.nonce and everyone[base + view.took + me] >= seq

    def _send(self, datagram: bytes, peer: Peer, seq: int) -> OSError | None:
        """Under the slab's lock: datagrams leave in sequence order, or the consumer would drop one as a replay. Each
        that left is noted in the consumer's ``sent`` word: if this session ends before the consumer took it, the
        pool leaves it for the consumer to read (and frees one that never left)."""
        if self.queued:
            self.queued.append((datagram, peer, seq))
            return None
        try:
            peer.sock.send(datagram)
        except BlockingIOError:  # the consumer's queue is full (a few datagrams): send it later, never wait
            self.queued.append((datagram, peer, seq))
            threading.Thread(target=self._flush, name="kvpool-slab-send", daemon=True).start()
        except OSError as exc:
            return exc
        else:
            self.slab.view.words[peer.sent] = seq
        return None

    def _unsent(
        self, request_id: str, to: str, exc: OSError, slots: Sequence[int], seq: int, tag: int
    ) -> HandoffRefused:
        kept = self._take_back(slots, seq, tag)
        n = len(slots)
        if kept is None:
            why = "its blocks are handed already: they are held for that session until it ends, then back to the pool"
        elif len(kept) == n:
            why = "nothing was handed: the blocks are still yours"
        else:
            why = (
                f"the pool had settled {n - len(kept)} of its blocks already (held for that session until it ends, "
                f"then back to the pool); these are still yours: {kept}"
            )
        err = HandoffRefused(f"the handoff of {request_id!r} could not reach {to!r} ({exc}); {why}")
        err.kept = tuple(kept or ())  # the ids still the caller's
        return err

    def _take_back(self, slots: Sequence[int], seq: int, tag: int) -> list[int] | None:
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

    def _mark(self, slots: Sequence[int], seq: int, peer: Peer) -> None:
        """Mark the slots handed to ``peer`` under ``seq`` (each slot's other fields first, its state last: readers
        read the state first)."""
        slab = self.slab
        words, tag, nonce = slab.view.words, peer.tag, peer.nonce
        if len(slots) <= FEW:
            for slot in slots:
                at = 8 + 4 * slot
                words[at + 2] = seq
                words[at + 3] = nonce
                words[at + 1] = tag
            return
        at = np.asarray(slots)
        slab.words[at, 2:] = (seq, nonce)
        slab.words[at, 1] = tag

    def _mark_run(self, first: int, n: int, seq: int, peer: Peer) -> None:
        """The same for consecutive slots, a column at a time, states last."""
        words, at = self.slab.view.words, 8 + 4 * first
        end = at + 4 * n
        words[at + 2 : end : 4] = column("Q", seq, n)
        words[at + 3 : end : 4] = peer.nonces[:n]
        words[at + 1 : end : 4] = peer.tags[:n]

    def _forget(self, ids: list[int]) -> None:
        """The handed blocks are no longer this slab's to alloc, free or hand."""
        slab = self.slab
        if len(ids) <= FEW:
            slot_at = slab.slot_at
            for fid in ids:
                slot_at[fid & BLOCK_MASK] = -1
        else:
            slab.slot_of[np.asarray(ids, np.int64) & BLOCK_MASK] = -1

    def _flush(self) -> None:
        """Send the queued datagrams in order as their consumers make room; one whose consumer is gone is dropped
        (the pool gives its blocks back when it settles)."""
        pause = FLUSH_S
        while True:
            with self.slab.lock:
                if not self.queued or self.closed:
                    self.queued.clear()
                    return
                datagram, peer, seq = self.queued[0]
                try:
                    peer.sock.send(datagram)
                except BlockingIOError:
                    pause = min(2 * pause, FLUSH_MAX_S)  # a consumer that does not read: no busy loop meanwhile
                except OSError as exc:
                    log.warning("dropped a slab handoff to %s: %s", peer.box, exc)
                    self.queued.popleft()
                else:
                    self.slab.view.words[peer.sent] = seq
                    self.queued.popleft()
                    pause = FLUSH_S
                    continue
            time.sleep(pause)

    def close(self) -> None:
        with self.slab.lock:
            self.closed = True
            for to in list(self.peers):
                self._drop(to)
