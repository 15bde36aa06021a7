"""A router's side of the KV-event stream, written from vLLM's published schema alone (no kvpool code).

The decoder reads msgpack into plain lists and dicts and picks fields by name (vLLM 0.26's tagged maps) or by
position (earlier releases' tagged arrays): ``[ts, events, data_parallel_rank]``; ``BlockStored`` is
``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name``, ``BlockRemoved`` is
``block_hashes, medium``. The subscriber follows the sequence numbers and asks the replay socket for what it missed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name")
REMOVED_FIELDS = ("block_hashes", "medium")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def decode_event(raw: Any) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        return raw["type"], raw
    tag, values = raw[0], raw[1:]
    names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(tag, ())
    return tag, dict(zip(names, values, strict=False))


def decode_batch(payload: bytes) -> tuple[float, list[tuple[str, dict[str, Any]]], int]:
    batch = msgspec.msgpack.decode(payload)
    ts, events = batch[0], batch[1]
    rank = batch[2] if len(batch) > 2 and batch[2] is not None else 0
    return ts, [decode_event(e) for e in events], rank


@dataclass
class Entry:
    parent: Any
    tokens: tuple[int, ...]
    medium: str | None
    rank: int


@dataclass
class RouterIndex:
    """hash -> what the stream said of it, as a KV-aware router keeps it."""

    blocks: dict[Any, Entry] = field(default_factory=dict)

    def apply(self, payload: bytes) -> None:
        _, events, rank = decode_batch(payload)
        for tag, f in events:
            if tag == "BlockStored":
                bs, tokens, parent = f["block_size"], f["token_ids"], f["parent_block_hash"]
                assert len(tokens) == bs * len(f["block_hashes"])
                for i, h in enumerate(f["block_hashes"]):
                    self.blocks[h] = Entry(parent, tuple(tokens[i * bs : (i + 1) * bs]), f["medium"], rank)
                    parent = h
            elif tag == "BlockRemoved":
                for h in f["block_hashes"]:
                    self.blocks.pop(h, None)
            elif tag == "AllBlocksCleared":
                self.blocks = {h: e for h, e in self.blocks.items() if e.rank != rank}
            else:
                raise AssertionError(f"unknown event {tag!r}")

    def view(self) -> dict[Any, tuple[Any, str | None, int]]:
        return {h: (e.parent, e.medium, e.rank) for h, e in self.blocks.items()}


class Subscriber:
    """SUB to the live stream, DEALER to the replay socket; applies batches in sequence order, none twice."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.index = RouterIndex()
        self.next_seq = 0
        self.replays = 0
        self.restarts = 0
        self.sub: zmq.Socket[bytes] | None = None
        self.connect()

    def connect(self) -> None:
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(self.endpoint)

    def disconnect(self) -> None:
        assert self.sub is not None
        self.sub.close(linger=0)
        self.sub = None

    def replay(self, start: int) -> None:
        """Ask for every kept batch from ``start`` on and apply those not applied yet."""
        self.replays += 1
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                assert dealer.poll(10_000), "the replay socket did not answer"
                _, topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return
                assert topic == self.topic
                self._apply(int.from_bytes(seq, "big"), payload)
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq == self.next_seq:
            self.index.apply(payload)
            self.next_seq += 1

    def receive(self, timeout_ms: int) -> bool:
        """Take one live message (and whatever it shows was missed); False if none came in time."""
        assert self.sub is not None
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == self.topic
        seq = int.from_bytes(seq_bytes, "big")
        if seq < self.next_seq:  # numbers only go up within a pool's life: a new pool, whose first batch clears
            self.restarts += 1
            self.next_seq = 0
        if seq > self.next_seq:
            self.replay(self.next_seq)
        self._apply(seq, payload)
        return True

    def catch_up(self, published: int, timeout_s: float = 20.0) -> None:
        """Receive until ``published`` batches have been applied (replaying the tail if it was missed)."""
        deadline = time.monotonic() + timeout_s
        while self.next_seq < published:
            assert time.monotonic() < deadline, f"applied {self.next_seq} of {published} batches"
            if not self.receive(200):
                self.replay(self.next_seq)

    def close(self) -> None:
        if self.sub is not None:
            self.disconnect()
        self.ctx.term()
