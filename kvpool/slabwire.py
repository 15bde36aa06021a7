"""The datagram of a handoff between two live sessions' slabs: the producer sends it, the pool is not on the way.

The producer first marks the blocks handed in its region of the lease table (to the consumer's region and nonce,
under the next sequence number), then sends the ids, their slots and that sequence to the consumer's lease box,
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

MAGIC = b"KVL1"
#: magic, producer region, number of ids, producer nonce, sequence, num_tokens, request id bytes, meta bytes;
#: then the slots (i32), the ids (i64), the request id, the meta JSON and the seal
HEAD = struct.Struct("<4sIIQQQHI")


@dataclass(slots=True)
class SlabHandoff:
    from_region: int
    from_nonce: int
    seq: int
    request_id: str
    num_tokens: int
    meta: dict[str, Any]
    slots: array  # int32
    packed: array  # the ids, int64


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
) -> bytes:
    """The sealed datagram; ``key`` is the pair's key or its :func:`sealer`; ``slots`` are int32 and ``ids`` int64,
    little-endian, already packed."""
    rid = request_id.encode()
    head = HEAD.pack(MAGIC, region, len(ids) // 8, nonce, seq, num_tokens, len(rid), len(meta))
    body = b"".join((head, slots, ids, rid, meta))
    return body + _mac(key, body)


def peek(data: memoryview) -> tuple[int, int] | None:
    """(producer region, nonce) of a datagram, to find its pair key; None if it is not one of ours."""
    if len(data) < HEAD.size + SEAL_BYTES or data[:4] != MAGIC:
        return None
    _, region, _, nonce, *_ = HEAD.unpack_from(data)
    return region, nonce


def decode(data: memoryview, key: bytes | Any) -> SlabHandoff | None:
    """The handoff a datagram carries, or None when it is malformed or its seal is not the pair's (``key``: the
    pair's key or its :func:`sealer`)."""
    if len(data) < HEAD.size + SEAL_BYTES:
        return None
    magic, region, n, nonce, seq, num_tokens, rid_len, meta_len = HEAD.unpack_from(data)
    at = HEAD.size + 12 * n
    if magic != MAGIC or len(data) != at + rid_len + meta_len + SEAL_BYTES:
        return None
    if not hmac.compare_digest(_mac(key, data[:-SEAL_BYTES]), data[-SEAL_BYTES:]):
        return None
    try:
        request_id = str(data[at : at + rid_len], "utf-8")
        meta = json.loads(data[at + rid_len : -SEAL_BYTES].tobytes()) if meta_len else {}
    except ValueError:
        return None
    slots, packed = array("i"), array("q")
    slots.frombytes(data[HEAD.size : HEAD.size + 4 * n])
    packed.frombytes(data[HEAD.size + 4 * n : at])
    meta = meta if isinstance(meta, dict) else {}
    return SlabHandoff(region, nonce, seq, request_id, num_tokens, meta, slots, packed)


__all__ = ["MAX_DATAGRAM", "SEAL_BYTES", "SlabHandoff", "decode", "encode", "pair_key", "peek", "sealer"]
