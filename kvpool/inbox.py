"""Direct delivery of a handoff: the producer sends its block ids straight to the consumer's inbox.

Through the pool, a handoff's critical path holds two process wake-ups (the pool's, then the waiting claimer's)
and the pool's books: hundreds of microseconds on an idle machine, while a device copy of a gigabyte of KV takes
about one millisecond. Here the producer first writes the handoff to the pool over the fast channel (the pool
records who owns the blocks, exactly as for any handoff), then sends the same ids to the consumer's *inbox*, a Unix
datagram socket: one system call. A consumer that spins on its inbox while it waits has them within microseconds,
and its claim goes to the pool pipelined (``accept``), so ownership moves in the books off the critical path.

Why the consumer may use the blocks before the pool has answered: from the moment the producer's handoff frame is
written, the pool holds it, and every ref on the blocks belongs to the producer's session, then to the parked
handoff, then to the consumer; at no point is a block unowned, so none can be freed or handed out again. If the
pool refuses the handoff (ids the producer did not hold, an expired producer session), the accept fails at once
with the reason (:class:`kvpool.errors.HandoffRefused`) and the consumer's next call to the pool raises it, before
it frees or grows the request. A datagram from another pool epoch is dropped (its ids index another arena).

An inbox is a path the pool names inside its own socket directory, with the pool socket's permissions: whoever
may write it may also talk to the pool and map the arena, so it widens no one's access.
"""

from __future__ import annotations

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

from kvpool.ids import unpack_ids

log = logging.getLogger(__name__)

MAGIC = b"KVH1"
#: magic, number of ids, num_tokens, meta bytes, request id bytes, epoch bytes; the ids follow, 4-byte aligned
HEAD = struct.Struct("<4sIQIHH")
#: a datagram larger than this is not sent; the consumer then gets the handoff through the pool
MAX_DATAGRAM = 1 << 20


@dataclass(slots=True)
class Delivery:
    request_id: str
    num_tokens: int
    meta: dict[str, Any]
    ids: array


def encode_delivery(epoch: str, request_id: str, ids: memoryview, num_tokens: int, meta: bytes) -> bytes:
    """The datagram of one handoff; ``ids`` are packed int32 (see :func:`kvpool.channel.pack_ids`), ``meta`` JSON."""
    rid, ep = request_id.encode(), epoch.encode()
    extra = b"" if meta == b"{}" else meta
    head = HEAD.pack(MAGIC, len(ids) // 4, num_tokens, len(extra), len(rid), len(ep))
    return b"".join((head, ids, ep, rid, extra))


def decode_delivery(data: memoryview, epoch: bytes) -> Delivery | None:
    """The handoff a datagram carries, or None for one that is malformed or from another pool epoch."""
    if len(data) < HEAD.size:
        return None
    magic, n, num_tokens, meta_len, rid_len, ep_len = HEAD.unpack_from(data)
    at = HEAD.size + 4 * n
    rid_at = at + ep_len
    if magic != MAGIC or len(data) != rid_at + rid_len + meta_len:
        return None
    if data[at:rid_at] != epoch:
        log.debug("dropped a handoff delivery of another pool epoch")
        return None
    try:
        request_id = str(data[rid_at : rid_at + rid_len], "utf-8")
        meta = json.loads(data[rid_at + rid_len :].tobytes()) if meta_len else {}
    except ValueError:
        return None
    return Delivery(request_id, num_tokens, meta if isinstance(meta, dict) else {}, unpack_ids(data[HEAD.size : at]))


class Inbox:
    """The consumer's side: a datagram socket bound at the path the pool named for its session."""

    def __init__(self, path: str, epoch: str, mode: int = 0o660) -> None:
        self.path = path
        self.epoch = epoch.encode()
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
            got = decode_delivery(view[:n], self.epoch)
            if got is not None:
                return got

    def close(self) -> None:
        self.sock.close()
        Path(self.path).unlink(missing_ok=True)


class Outbox:
    """The producer's side: one unbound datagram socket that sends to any inbox."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)  # a full inbox must never stall a producer: it falls back to the pool
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
