"""Direct delivery: the datagram a producer sends to a consumer's inbox, over real Unix sockets."""

from __future__ import annotations

import os
import stat
import time
from array import array

import pytest

from kvpool.ids import pack_ids
from kvpool.inbox import (
    HEAD,
    MAX_DATAGRAM,
    SEAL_BYTES,
    Inbox,
    Outbox,
    decode_delivery,
    encode_delivery,
    seal_delivery,
)

EPOCH = "0123456789abcdef"
KEY = bytes(range(32))


def datagram(
    request_id: str = "req-1",
    ids: list[int] | None = None,
    meta: bytes = b'{"first_token":5}',
    key: bytes = KEY,
    epoch: str = EPOCH,
    seq: int = 1,
) -> bytes:
    """A delivery sealed as the pool seals it (with the addressee's key)."""
    packed = pack_ids(array("q", [4, 9, 2] if ids is None else ids))
    assert packed is not None
    unsealed = encode_delivery(epoch, request_id, packed, 37, meta, seq)
    return unsealed[:-SEAL_BYTES] + seal_delivery(key, unsealed)


def test_a_delivery_round_trips():
    got = decode_delivery(memoryview(datagram("r-é")), EPOCH.encode(), KEY)
    assert got is not None
    assert (got.request_id, got.num_tokens, got.meta, got.ids.tolist()) == ("r-é", 37, {"first_token": 5}, [4, 9, 2])
    assert got.seq == 1
    fenced = decode_delivery(memoryview(datagram(ids=[3 << 32 | 7, 2**63 - 1], seq=9)), EPOCH.encode(), KEY)
    assert fenced is not None and fenced.ids.tolist() == [3 << 32 | 7, 2**63 - 1] and fenced.seq == 9
    empty = decode_delivery(memoryview(datagram(meta=b"{}")), EPOCH.encode(), KEY)
    assert empty is not None and empty.meta == {}


def test_a_delivery_says_who_parked_it_under_the_seal():
    unsealed = encode_delivery(EPOCH, "r", memoryview(pack_ids([1, 2])), 8, b"{}", 3, parked_by="prefill-é")
    sealed = unsealed[:-SEAL_BYTES] + seal_delivery(KEY, unsealed)
    got = decode_delivery(memoryview(sealed), EPOCH.encode(), KEY)
    assert got is not None and (got.parked_by, got.ids.tolist(), got.seq) == ("prefill-é", [1, 2], 3)
    forged = sealed.replace(b"prefill-\xc3\xa9", b"attacker\xc3\xa9")
    assert decode_delivery(memoryview(forged), EPOCH.encode(), KEY) is None


def test_a_delivery_of_another_pool_epoch_is_dropped():
    assert decode_delivery(memoryview(datagram()), b"fedcba9876543210", KEY) is None


def test_a_delivery_without_the_pools_seal_is_dropped():
    """Whoever can write to the inbox but has not the addressee's key cannot make it take ids."""
    assert decode_delivery(memoryview(datagram(key=bytes(32))), EPOCH.encode(), KEY) is None
    unsealed = encode_delivery(EPOCH, "req-1", memoryview(bytes([1, 0, 0, 0, 0, 0, 0, 0])), 4, b"{}", 1)
    assert decode_delivery(memoryview(unsealed), EPOCH.encode(), KEY) is None
    # A sealed delivery with one id, or its number, changed is no longer sealed.
    for at in (HEAD.size, HEAD.size + 4 * 8 - 1, 16):
        forged = bytearray(datagram())
        forged[at] ^= 1
        assert decode_delivery(memoryview(bytes(forged)), EPOCH.encode(), KEY) is None


@pytest.mark.parametrize(
    "mangle",
    [
        lambda d: d[:10],
        lambda d: d[:-1],
        lambda d: d + b"x",
        lambda d: b"XXXX" + d[4:],
        lambda d: d[: -17 - SEAL_BYTES] + b"{" * 17 + d[-SEAL_BYTES:],
    ],
    ids=["truncated-head", "short", "long", "bad-magic", "bad-meta"],
)
def test_a_malformed_delivery_is_dropped(mangle):
    assert decode_delivery(memoryview(mangle(datagram())), EPOCH.encode(), KEY) is None


@pytest.fixture
def inbox(tmp_path):
    box = Inbox(str(tmp_path / "inbox-test.sock"), EPOCH, KEY, mode=0o600)
    yield box
    box.close()


def test_outbox_to_inbox_over_a_real_socket(inbox):
    out = Outbox()
    try:
        assert stat.S_IMODE(os.stat(inbox.path).st_mode) == 0o600
        assert out.send(inbox.path, datagram("a", list(range(4096))))
        got = inbox.receive(time.perf_counter() + 5)
        assert got is not None and got.request_id == "a" and got.ids.tolist() == list(range(4096))
    finally:
        out.close()


def test_receive_gives_up_at_its_deadline(inbox):
    t0 = time.perf_counter()
    assert inbox.receive(t0 + 0.05) is None
    assert 0.05 <= time.perf_counter() - t0 < 1.0
    assert inbox.receive(0) is None  # a deadline already past still looks once


def test_foreign_datagrams_are_skipped_not_returned(inbox):
    out = Outbox()
    try:
        out.send(inbox.path, b"not a delivery")
        out.send(inbox.path, datagram("x", epoch="another-epoch"))
        out.send(inbox.path, encode_delivery(EPOCH, "unsealed", memoryview(b""), 0, b"{}", 1))
        out.send(inbox.path, datagram("mine"))
        got = inbox.receive(time.perf_counter() + 5)
        assert got is not None and got.request_id == "mine"
    finally:
        out.close()


def test_a_replayed_delivery_is_dropped(inbox):
    """A datagram sent again later (its blocks claimed, freed and reused since) keeps a valid seal: its number, no
    newer than the last one the inbox took, is what gives it away."""
    out = Outbox()
    try:
        first, second = datagram("a", [1 << 32 | 4], seq=1), datagram("b", [5], seq=2)
        for sent in (first, second, first, second, datagram("c", [6], seq=3)):
            assert out.send(inbox.path, sent)
        got = [inbox.receive(time.perf_counter() + 5) for _ in range(3)]
        assert [(d.request_id, d.seq) for d in got if d is not None] == [("a", 1), ("b", 2), ("c", 3)]
        assert inbox.receive(time.perf_counter() + 0.01) is None
    finally:
        out.close()


def test_an_undeliverable_datagram_is_a_miss_never_an_error(tmp_path, inbox):
    out = Outbox()
    try:
        assert not out.send(str(tmp_path / "nobody.sock"), datagram())  # no such inbox
        (tmp_path / "file.sock").write_text("")
        assert not out.send(str(tmp_path / "file.sock"), datagram())  # not a socket
        assert not out.send(inbox.path, b"\0" * (MAX_DATAGRAM + 1))  # too large
        sent = 0
        while out.send(inbox.path, datagram()):  # the queue fills: the producer is never stalled
            sent += 1
            assert sent < 100_000
    finally:
        out.close()


def test_closing_an_inbox_removes_its_socket(tmp_path):
    box = Inbox(str(tmp_path / "inbox-x.sock"), EPOCH, KEY)
    box.close()
    assert not (tmp_path / "inbox-x.sock").exists()
