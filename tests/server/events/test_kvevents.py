"""KV events on the wire: vLLM's format (checked with vLLM's own classes when vLLM is importable), the index
listener under every way the index changes (duplicates, orphans taken over, evictions, several arenas), the
publisher's replay and drop counting, and the settings."""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest
import zmq
from pydantic import ValidationError

from kvpool.layout import KVLayout
from kvpool.server.books.pool import Pool
from kvpool.server.config import PoolSettings
from kvpool.server.events.feed import index_listing, media_of
from kvpool.server.events.kvevents import IndexEvents, RawEvent, encode_batch, encode_event, external_hash
from kvpool.server.events.publisher import EventPublisher, binds
from tests.server.kv_router import END_SEQ, RouterIndex, decode_batch

BS = 2
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, dtype="float32")
KEY = bytes(range(16))

STORED: RawEvent = ("stored", [KEY, bytes(16)], None, bytes([1, 0, 0, 0, 2, 0, 0, 0] * 2), BS, "GPU")
REMOVED: RawEvent = ("removed", [KEY], "CPU")
CLEARED: RawEvent = ("cleared",)


def test_map_form_has_vllm_fields_in_order() -> None:
    payload = msgspec.msgpack.encode(encode_batch([encode_event(e) for e in (STORED, REMOVED, CLEARED)], 3, 1.5))
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert (ts, rank) == (1.5, 3)
    assert list(events[0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name"]  # fmt: skip
    assert events[0]["block_hashes"] == [int.from_bytes(KEY[8:], "big"), 0]
    assert events[0]["token_ids"] == [1, 2, 1, 2] and events[0]["medium"] == "GPU"
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [int.from_bytes(KEY[8:], "big")], "medium": "CPU"}
    assert events[2] == {"type": "AllBlocksCleared"}


def test_array_form_and_bytes_hashes() -> None:
    stored = encode_event(STORED, "bytes", "array")
    assert stored == ["BlockStored", [KEY, bytes(16)], None, [1, 2, 1, 2], BS, None, "GPU", None]
    assert encode_event(REMOVED, "bytes", "array") == ["BlockRemoved", [KEY], "CPU"]
    assert encode_event(CLEARED, "int", "array") == ["AllBlocksCleared"]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    """Earlier vLLM releases' events: tagged arrays (their example subscriber's classes)."""


class OldStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class OldRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None


class OldCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[OldStored | OldRemoved | OldCleared]
    data_parallel_rank: int | None = None


def test_array_form_decodes_as_earlier_vllm_classes() -> None:
    events = [encode_event(e, "int", "array") for e in (STORED, REMOVED, CLEARED)]
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(encode_batch(events, 2, 1.0)), type=OldBatch)
    stored, removed, cleared = batch.events
    assert isinstance(stored, OldStored) and isinstance(removed, OldRemoved) and isinstance(cleared, OldCleared)
    assert stored.token_ids == [1, 2, 1, 2] and stored.medium == "GPU" and removed.medium == "CPU"
    assert batch.data_parallel_rank == 2


def test_int_hash_is_vllms_conversion() -> None:
    """vLLM's maybe_convert_block_hash: the big-endian integer of the hash bytes, masked to 64 bits."""
    assert external_hash(KEY) == int.from_bytes(KEY, "big") & ((1 << 64) - 1) == int.from_bytes(KEY[8:], "big")
    assert external_hash(KEY, "bytes") == KEY


def test_vllm_decodes_our_bytes() -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    events = [encode_event(e) for e in (STORED, REMOVED, CLEARED)]
    ours = msgspec.msgpack.encode(encode_batch(events, 0, 2.5))
    batch = msgspec.msgpack.Decoder(kv.KVEventBatch).decode(ours)
    stored, removed, cleared = batch.events
    assert isinstance(stored, kv.BlockStored) and isinstance(removed, kv.BlockRemoved)
    assert isinstance(cleared, kv.AllBlocksCleared)
    assert stored.block_hashes == [external_hash(KEY), 0] and stored.parent_block_hash is None
    assert stored.token_ids == [1, 2, 1, 2] and stored.block_size == BS and stored.medium == "GPU"
    assert removed.block_hashes == [external_hash(KEY)] and removed.medium == "CPU"
    theirs = kv.KVEventBatch(
        ts=2.5,
        events=[
            kv.BlockStored(
                block_hashes=[external_hash(KEY), 0],
                parent_block_hash=None,
                token_ids=[1, 2, 1, 2],
                block_size=BS,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            ),
            kv.BlockRemoved(block_hashes=[external_hash(KEY)], medium="CPU"),
            kv.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    assert msgspec.msgpack.encode(theirs) == ours  # byte for byte what vLLM's publisher sends


class Recorder:
    """A publisher stand-in: encodes each event as the publisher's thread would and feeds a router index."""

    def __init__(self, hashes: Any = "int", form: Any = "map") -> None:
        self.router = RouterIndex()
        self.hashes, self.form = hashes, form

    def put(self, rank: int, raw: RawEvent) -> None:
        event = encode_event(raw, self.hashes, self.form)
        self.router.apply(msgspec.msgpack.encode(encode_batch([event], rank)))


def pool_with_events(sizes: list[int], hashes: Any = "int", form: Any = "map") -> tuple[Pool, Recorder, list[int]]:
    recorder = Recorder(hashes, form)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    listener = IndexEvents(recorder.put, BS, starts, media_of("cuda", len(sizes)))
    return Pool(sizes, LAYOUT, index_listener=listener), recorder, starts


def assert_mirrors(pool: Pool, recorder: Recorder, starts: list[int]) -> None:
    listing = index_listing(pool.index, starts, media_of("cuda", len(starts)), recorder.hashes, 10**6)
    name = (lambda v: bytes.fromhex(v)) if recorder.hashes == "bytes" else (lambda v: v)
    expected = {name(b["hash"]): (None if b["parent"] is None else name(b["parent"]), b["medium"], b["rank"])
                for b in listing["blocks"]}  # fmt: skip
    assert recorder.router.view() == expected


def test_orphan_taken_over_keeps_router_exact() -> None:
    """A parent evicted before its children, the chain committed again: the children's keys move to new blocks,
    and evicting the old blocks later must not remove what is findable."""
    pool, rec, starts = pool_with_events([6])
    sid = pool.open_session("w", "other").session_id
    tokens = [1, 2, 3, 4, 5, 6]
    a, b, c = pool.alloc(sid, 3)
    pool.commit(sid, [a, b, c], tokens)
    pool.free(sid, [a])  # the root goes to the LRU first, so it is evicted first
    pool.free(sid, [b, c])
    assert_mirrors(pool, rec, starts)
    pool.free(sid, pool.alloc(sid, 4))  # 3 free blocks and the root: b and c are orphans now
    assert len(rec.router.blocks) == 2
    assert_mirrors(pool, rec, starts)
    ids = pool.alloc(sid, 3)  # free blocks: b and c stay cached, and the new chain takes their keys over
    assert not {b, c} & set(ids)
    pool.commit(sid, ids, tokens)
    assert len(rec.router.blocks) == 3
    assert_mirrors(pool, rec, starts)
    pool.free(sid, ids)
    pool.free(sid, pool.alloc(sid, 3))  # evicts the old b and c first: what is findable stays
    assert len(rec.router.blocks) == 3
    assert_mirrors(pool, rec, starts)
    pool.free(sid, pool.alloc(sid, 6))  # everything evicted
    assert rec.router.blocks == {}
    assert_mirrors(pool, rec, starts)
    pool.allocator.check()


@pytest.mark.parametrize("seed", range(6))
def test_random_workload_router_mirrors_index(seed: int) -> None:
    rng = random.Random(seed)
    hashes, form = rng.choice(["int", "bytes"]), rng.choice(["map", "array"])
    pool, rec, starts = pool_with_events([10, 7], hashes, form)
    sessions = [pool.open_session(f"w{i}", "other").session_id for i in range(2)]
    held: list[tuple[str, list[int]]] = []
    prefixes = [[rng.randrange(20) for _ in range(8)] for _ in range(3)]
    for _ in range(300):
        sid, arena = rng.choice(sessions), rng.randrange(2)
        tokens = rng.choice(prefixes)[: rng.randint(0, 8)] + [rng.randrange(20) for _ in range(rng.randint(0, 4))]
        hit = pool.lookup(sid, tokens, arena).block_ids
        need = -(-len(tokens) // BS) - len(hit)
        ids = list(hit)
        if need and need <= pool.allocator.available(arena):
            ids += pool.alloc(sid, need, arena)
            pool.commit(sid, ids, tokens)
        if ids:
            held.append((sid, ids))
        while held and (len(held) > 3 or rng.random() < 0.5):
            owner, blocks = held.pop(rng.randrange(len(held)))
            order = blocks if rng.random() < 0.5 else blocks[::-1]
            for i in range(0, len(order), 2):  # partial frees put parents and children in any LRU order
                pool.free(owner, order[i : i + 2])
        assert_mirrors(pool, rec, starts)
    pool.allocator.check()
    assert pool.allocator.num_evictions > 0


def test_publisher_replays_and_counts() -> None:
    pub = EventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="t", buffer_steps=2)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        for raw in (STORED, REMOVED, CLEARED):
            pub.put(1, raw)
            deadline = time.monotonic() + 10
            while pub.stats()["pending"]:  # one batch each, so that the buffer keeps the last two
                assert time.monotonic() < deadline
                time.sleep(0.01)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", b"bad", b"request"))  # ignored, and the socket keeps serving
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        got = []
        while True:
            assert dealer.poll(10_000)
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                break
            assert topic == b"t"
            got.append((int.from_bytes(seq, "big"), decode_batch(payload)[1][0][0], decode_batch(payload)[2]))
        assert got == [(1, "BlockRemoved", 1), (2, "AllBlocksCleared", 1)]  # seq 0 fell out of the buffer
        stats = pub.stats()
        assert (stats["published"], stats["batches"], stats["replay_requests"], stats["dropped"]) == (3, 3, 1, 0)
    finally:
        dealer.close(linger=0)
        ctx.term()
        pub.close()


def test_connects_to_a_subscriber_that_binds() -> None:
    """llm-d's central indexer binds one SUB socket and every publisher connects to it."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    assert not binds(endpoint, "auto") and binds("tcp://*:5557", "auto") and binds("ipc:///tmp/x", "auto")
    pub = EventPublisher(endpoint, mode="auto")
    try:
        for _ in range(100):  # what is sent before the connection is up is lost, as with any PUB socket
            pub.put(0, CLEARED)
            if sub.poll(100):
                break
        payload = sub.recv_multipart()[2]
        assert decode_batch(payload)[1][0][0] == "AllBlocksCleared"
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()


def test_full_queue_drops_and_counts() -> None:
    pub = EventPublisher("tcp://127.0.0.1:*", queue_size=1)
    pub.close()  # nothing drains the queue any more
    pub.put(0, CLEARED)
    pub.put(0, CLEARED)
    assert pub.stats()["dropped"] == 1


def test_bind_failure_names_the_flag() -> None:
    first = EventPublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(Exception, match="--kv-events-endpoint"):
            EventPublisher(first.endpoint)
    finally:
        first.close()


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}, "needs --kv-events-endpoint"),
        ({"kv_events_endpoint": "127.0.0.1:5557"}, "tcp://, ipc:// or inproc://"),
        ({"kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:5557"},
         "different addresses"),
        ({"kv_events_hashes": "hex"}, "int"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused(given: dict[str, str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PoolSettings(socket=None, **given)
    assert PoolSettings(socket=None, kv_events_endpoint="off").kv_events_endpoint is None


@pytest.mark.parametrize("salt", [None, "tenant-a", "é"])
def test_a_salted_chain_announces_its_tokens_not_its_salt(salt: str | None) -> None:
    """The index keeps a salt's tag before a salted chain's first tokens; an event carries the tokens alone."""
    events: list[RawEvent] = []
    listener = IndexEvents(lambda rank, raw: events.append(raw), BS, [0], media_of("cpu", 1))
    pool = Pool([8], LAYOUT, index_listener=listener)
    sid = pool.open_session("w", "other").session_id
    tokens = [5, 6, 7, 8, 9]
    pool.commit(sid, pool.alloc(sid, 3), tokens, salt=salt)
    (stored,) = [e for e in events if e[0] == "stored"]
    event = msgspec.msgpack.decode(msgspec.msgpack.encode(encode_event(stored, "int", "map")))
    assert event["token_ids"] == tokens[:4]
