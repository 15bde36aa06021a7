"""Direct delivery of a handoff: the pool sends its block ids straight to the consumer's inbox.

Through a claim waiting in the pool, a handoff's critical path holds two process wake-ups (the pool's, then the
waiting claimer's, blocked in a read) and the pool's books: hundreds of microseconds on an idle machine, while a
device copy of a gigabyte of KV takes about one millisecond. Here, as soon as its books took an addressed handoff,
the pool sends its ids to the consumer's *inbox*, a Unix datagram socket (one system call), before it answers the
producer. A consumer that spins on its inbox while it waits has them within microseconds of the pool, and its claim
goes to the pool pipelined (``accept``), so ownership moves in the books off the critical path.

Every delivery is sealed: a keyed BLAKE2b MAC over the datagram, made with a key the pool gave the addressee alone
when it opened its session. An inbox takes no ids without a valid seal: whoever else can write to the inbox (a
member of the socket's group without the token, a process with no session, a stale copy from another epoch)
cannot make a claim return ids the pool did not park for this consumer. So the ids a consumer reads before the
pool has answered its claim are blocks the pool already holds for it: every ref on them belongs to the parked
handoff, then to the consumer, and none can be freed or handed out again in between. The pool's answer to the
claim (``accept``) then only moves the refs in the books.

A seal vouches for a datagram, not for when it is read: the same datagram sent again later (replayed by whoever
recorded it, after its blocks were claimed, freed and handed to someone else) would carry a valid seal and stale
ids. So each delivery also carries its number in the session's sequence (sealed with it), and an inbox takes only
numbers above the last one it took: the pool sends a session's deliveries in order from one socket, and a Unix
datagram socket keeps that order, so a replay, or a copy, is never newer than what the inbox already has.

An inbox is a path the pool names inside its own socket directory, with the pool socket's permissions.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import struct
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpool.ids import ITEM, unpack_ids

log = logging.getLogger(__name__)

MAGIC = b"KVH4"
#: magic, number of ids, num_tokens, the delivery's number in its session, meta bytes, request id bytes, epoch
#: bytes, parked_by bytes; the ids (fenced, int64) follow, 8-byte aligned, then the epoch, the request id, the name
#: of the session that parked it, the meta JSON and last the seal
HEAD = struct.Struct("<4sIQQIHHH")
SEAL_BYTES = 16
#: a datagram larger than this is not sent; the consumer then gets the handoff through the pool
MAX_DATAGRAM = 1 << 20


@dataclass(slots=True)
class Delivery:
    request_id: str
    num_tokens: int
    meta: dict[str, Any]
    ids: array
    seq: int = 0
    parked_by: str = ""  # the name of the session that parked it, as the pool knew it (sealed with the rest)


def encode_delivery(
    epoch: str,
    request_id: str,
    ids: memoryview,
    num_tokens: int,
    meta: bytes,
    seq: int,
    seal: bytes = bytes(SEAL_BYTES),
    parked_by: str = "",
) -> bytes:
    """The datagram of one handoff; ``ids`` are packed int64 (see :func:`kvpool.ids.pack_ids`), ``meta`` JSON,
    ``seq`` the delivery's number in its session (from 1).

    Without ``seal`` it is what the pool seals (:func:`seal_delivery`), with room left for the seal at its end.
    """
    rid, ep, by = request_id.encode(), epoch.encode(), parked_by.encode()
    extra = b"" if meta == b"{}" else meta
    head = HEAD.pack(MAGIC, len(ids) // ITEM, num_tokens, seq, len(extra), len(rid), len(ep), len(by))
    return b"".join((head, ids, ep, rid, by, extra, seal))


def seal_delivery(key: bytes, datagram: bytes) -> bytes:
    """The seal of a datagram (with its seal field zeroed, as :func:`encode_delivery` leaves it without one)."""
    return hashlib.blake2b(memoryview(datagram)[:-SEAL_BYTES], key=key, digest_size=SEAL_BYTES).digest()


def decode_delivery(data: memoryview, epoch: bytes, key: bytes) -> Delivery | None:
    """The handoff a datagram carries, or None for one that is malformed, unsealed, or from another pool epoch."""
    if len(data) < HEAD.size + SEAL_BYTES:
        return None
    magic, n, num_tokens, seq, meta_len, rid_len, ep_len, by_len = HEAD.unpack_from(data)
    at = HEAD.size + ITEM * n
    rid_at = at + ep_len
    by_at = rid_at + rid_len
    if magic != MAGIC or len(data) != by_at + by_len + meta_len + SEAL_BYTES:
        return None
    mac = hashlib.blake2b(data[:-SEAL_BYTES], key=key, digest_size=SEAL_BYTES).digest()
    if not hmac.compare_digest(mac, data[-SEAL_BYTES:]):
        log.debug("dropped a handoff delivery without the pool's seal")
        return None
    if data[at:rid_at] != epoch:
        log.debug("dropped a handoff delivery of another pool epoch")
        return None
    try:
        request_id = str(data[rid_at:by_at], "utf-8")
        parked_by = str(data[by_at : by_at + by_len], "utf-8")
        meta = json.loads(data[by_at + by_len : -SEAL_BYTES].tobytes()) if meta_len else {}
    except ValueError:
        return None
    ids = unpack_ids(data[HEAD.size : at])
    return Delivery(request_id, num_tokens, meta if isinstance(meta, dict) else {}, ids, seq, parked_by)


class Inbox:
    """The consumer's side: a datagram socket bound at the path the pool named for its session, taking only
    deliveries sealed with ``key``, each numbered above the last it took."""

    def __init__(self, path: str, epoch: str, key: bytes, mode: int = 0o660) -> None:
        self.path = path
        self.epoch = epoch.encode()
        self.key = key
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(path)
            os.chmod(path, mode)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * MAX_DATAGRAM)
        except OSError:
            self.sock.close()
            raise
        self._buf = bytearray(MAX_DATAGRAM)
        self._view = memoryview(self._buf)
        self.last = 0  # the number of the last delivery taken

    def receive(self, until: float) -> Delivery | None:
        """The next delivery, spinning until ``time.perf_counter()`` reaches ``until`` (at least one look)."""
        sock, buf, view = self.sock, self._buf, self._view
        while True:
            try:
                n = sock.recv_into(buf, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if time.perf_counter() >= until:
                    return None
                continue
            got = decode_delivery(view[:n], self.epoch, self.key)
            if got is None:
                continue
            if got.seq <= self.last:
                log.debug("dropped a replayed handoff delivery (number %d, last taken %d)", got.seq, self.last)
                continue
            self.last = got.seq
            return got

    def close(self) -> None:
        self.sock.close()
        Path(self.path).unlink(missing_ok=True)


class Outbox:
    """The pool's side: one unbound datagram socket that sends to any inbox."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)  # a full inbox must never stall the pool: its claim falls back to the pool
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MAX_DATAGRAM)

    def send(self, path: str, datagram: bytes) -> bool:
        """Whether the inbox took it; a miss is never an error, since the handoff is parked in the pool anyway."""
        if len(datagram) > MAX_DATAGRAM:
            return False
        try:
            self.sock.sendto(datagram, path)
        except OSError as exc:  # no such inbox, nobody bound to it, its queue full, too large: all a miss
            log.debug("handoff not delivered to %s: %s", path, exc)
            return False
        return True

    def close(self) -> None:
        self.sock.close()
