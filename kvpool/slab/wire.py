"""The datagram of a handoff between two live sessions' slabs: the producer sends it, the pool is not on the way.

The producer first marks the blocks handed in its region of the slab table (to the consumer's region and nonce,
under the next sequence number), then sends the ids, their slots (the first slot alone when they sit in a run of
consecutive slots, as a slab hands them out) and that sequence to the consumer's slab box,
sealed with the key the pool issued for this producer-consumer pair (a keyed BLAKE2b MAC, issued once per pair,
never per handoff). The consumer takes the ids only if the seal holds, the sequence is newer than every one it took
from that producer, and the producer's region (mapped read-only) says the same thing as the datagram.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from array import array
from dataclasses import dataclass
from typing import Any

from kvpool.inbox import MAX_DATAGRAM, SEAL_BYTES

MAGIC = b"KVL2"
#: magic, producer region, number of ids, producer nonce, sequence, num_tokens, request id bytes, meta bytes, first
#: slot of a run (-1: slots listed); then the slots (i32, unless a run), the ids (i64), request id, meta JSON, seal
HEAD = struct.Struct("<4sIIQQQHIi")


@dataclass(slots=True)
class SlabHandoff:
    from_region: int
    from_nonce: int
    seq: int
    request_id: str
    num_tokens: int
    meta: dict[str, Any]
    slots: array  # int32; empty when ``run`` is set
    packed: array  # the ids, int64
    run: int  # the ids sit in slots run, run + 1, ...; -1 when ``slots`` lists them


def pair_key(secret: bytes, producer: str, consumer: str) -> bytes:
    """The key a producer seals its handoffs to a consumer with (the pool's secret never leaves the pool)."""
    return hashlib.blake2b(f"{producer}>{consumer}".encode(), key=secret, digest_size=32).digest()


def sealer(key: bytes) -> Any:
    """The pair's keyed MAC with its key already absorbed: each seal copies it (a third cheaper than keying anew)."""
    return hashlib.blake2b(key=key, digest_size=SEAL_BYTES)


def _mac(key: bytes | Any, data: bytes | memoryview) -> bytes:
    mac = sealer(key) if isinstance(key, bytes) else key.copy()
    mac.update(data)
    return mac.digest()


def encode(
    key: bytes | Any,
    region: int,
    nonce: int,
    seq: int,
    request_id: str,
    num_tokens: int,
    meta: bytes,
    slots: bytes,
    ids: bytes,
    run: int = -1,
) -> bytes:
    """The sealed datagram; ``key`` is the pair's key or its :func:`sealer`; ``slots`` are int32 and ``ids`` int64,
    little-endian, already packed; with ``run`` (the first of consecutive slots), ``slots`` is empty."""
    rid = request_id.encode()
    head = HEAD.pack(MAGIC, region, len(ids) // 8, nonce, seq, num_tokens, len(rid), len(meta), run)
    body = b"".join((head, slots, ids, rid, meta))
    return body + _mac(key, body)


def head(data: memoryview) -> tuple[Any, ...] | None:
    """The header's fields of a datagram, or None if it is not one of ours."""
    if len(data) < HEAD.size + SEAL_BYTES:
        return None
    fields = HEAD.unpack_from(data)
    return fields if fields[0] == MAGIC else None


def peek(data: memoryview) -> tuple[int, int] | None:
    """(producer region, nonce) of a datagram, to find its pair key; None if it is not one of ours."""
    fields = head(data)
    return None if fields is None else (fields[1], fields[3])


def decode(data: memoryview, key: bytes | Any, fields: tuple[Any, ...] | None = None) -> SlabHandoff | None:
    """The handoff a datagram carries, or None when it is malformed or its seal is not the pair's (``key``: the
    pair's key or its :func:`sealer`; ``fields``: its :func:`head`, if read already)."""
    if fields is None and (fields := head(data)) is None:
        return None
    _, region, n, nonce, seq, num_tokens, rid_len, meta_len, run = fields
    listed = 4 * n if run < 0 else 0
    at = HEAD.size + listed + 8 * n
    if len(data) != at + rid_len + meta_len + SEAL_BYTES:
        return None
    if not hmac.compare_digest(_mac(key, data[:-SEAL_BYTES]), data[-SEAL_BYTES:]):
        return None
    try:
        request_id = str(data[at : at + rid_len], "utf-8")
        meta = json.loads(data[at + rid_len : -SEAL_BYTES].tobytes()) if meta_len else {}
    except ValueError:
        return None
    packed, slots = array("q"), array("i")  # no slots listed for a run: they follow from its first
    packed.frombytes(data[HEAD.size + listed : at])
    if listed:
        slots.frombytes(data[HEAD.size : HEAD.size + listed])
    return SlabHandoff(region, nonce, seq, request_id, num_tokens, meta if type(meta) is dict else {}, slots, packed,
                       run)  # fmt: skip


__all__ = ["MAX_DATAGRAM", "SEAL_BYTES", "SlabHandoff", "decode", "encode", "head", "pair_key", "peek", "sealer"]
