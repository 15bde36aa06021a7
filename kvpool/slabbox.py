"""Handoffs from another live session's slab to this one's, the consumer's side: its lease box.

A producer marks the blocks it hands in its region of the lease table and sends this session's box one datagram
sealed with their pair's key (:mod:`kvpool.slabsend`, :mod:`kvpool.slabwire`). This side takes the ids only if the
seal holds, the sequence is newer than any it took from that producer (a replay is dropped), and the producer's
region, mapped read-only, says the same: those blocks, handed to this session under this sequence (a run of
consecutive slots is compared a column at a time). If the region says otherwise because the pool already moved
the refs (the producer ended, or reused settled slots), it asks the pool whether it holds them now, and takes
them only if so. The refs move in the pool's books afterwards (the pool settles them: docs/operations.md,
"Slabs"); this client has them settled before it names those blocks in any call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from kvpool import slabwire
from kvpool.errors import InvalidRequest, KvpoolError, UnknownSession
from kvpool.handoffs import Claim
from kvpool.lease_protocol import PairRequest, PairResponse
from kvpool.leases import HANDED, NONCE, PAGE, column
from kvpool.slab import Slab

log = logging.getLogger(__name__)

#: up to this many ids the producer's slots are checked one at a time (numpy's per-call cost is a microsecond)
FEW = 128


class SlabBox:
    def __init__(self, slab: Slab, mode: int) -> None:
        self.slab = slab
        self.transport = slab.transport
        self.keys: dict[tuple[int, int], Any] = {}  # the pairs' sealers, by (producer region, nonce)
        self.last_seq: dict[tuple[int, int], int] = {}
        self.delivered: OrderedDict[str, Claim] = OrderedDict()
        self.to_settle: set[int] = set()
        self.sock: socket.socket | None = None
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
                self.sock = box
        self._buf = bytearray(slabwire.MAX_DATAGRAM)
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
        while True:
            got = self.delivered.pop(request_id, None) if request_id is not None else None
            if got is None and request_id is None and self.delivered:
                got = self.delivered.popitem(last=False)[1]
            if got is not None:
                return got
            try:
                n = self.sock.recv_into(self._buf, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                now = time.perf_counter()
                if now >= until:
                    return None
                if now >= spin_until:
                    select.select([self.sock], [], [], until - now)
                continue
            claim = self._take(memoryview(self._buf)[:n])
            if claim is not None:
                if request_id is None or claim.request_id == request_id:
                    return claim
                self.delivered[claim.request_id] = claim

    def _take(self, data: memoryview) -> Claim | None:
        fields = slabwire.head(data)
        if fields is None:
            return None
        pair = fields[1], fields[3]
        key = self.keys.get(pair)
        if key is None:
            try:
                req = PairRequest(session_id=self.slab.session_id, from_region=pair[0], from_nonce=pair[1])
                got = self.transport.fetch("POST", "/leases/pair", req, PairResponse)
                key = self.keys[pair] = slabwire.sealer(bytes.fromhex(got.key))
            except (UnknownSession, InvalidRequest) as exc:
                log.debug("dropped a slab handoff from region %d: %s", pair[0], exc)
                return None
        h = slabwire.decode(data, key, fields)
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
        return Claim(h.request_id, h.num_tokens, h.meta, h.packed, None, True)

    def _vouched(self, h: slabwire.SlabHandoff) -> bool:
        """Whether the producer's region says these blocks are handed to this session under this sequence: each slot
        must read (id, handed | this region, this sequence, this nonce), word for word."""
        view, info, n = self.slab.view, self.slab.info, len(h.packed)
        if not n or not 0 <= h.from_region < view.regions:
            return False
        words, base = view.all_words, PAGE // 8 + h.from_region * view.region_words
        if words[base + NONCE] != h.from_nonce:
            return False
        tag, seq, nonce, capacity = HANDED | info.region << 32, h.seq, info.nonce, self.slab.capacity
        if h.run >= 0:  # a column at a time
            if not 0 <= h.run <= capacity - n:
                return False
            at = base + 8 + 4 * h.run
            end = at + 4 * n
            if words[at + 1 : end : 4] != self._tags[:n] or words[at:end:4] != memoryview(h.packed).cast("B").cast("Q"):
                return False
            if words[at + 2 : end : 4] != column("Q", seq, n) or words[at + 3 : end : 4] != self._nonces[:n]:
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
        if self.sock is not None:
            self.sock.close()
            with contextlib.suppress(OSError):
                os.unlink(self.slab.info.box or "")
