"""The fast channel's framing: block ids packed as int64 in both directions, and their refusals."""

from __future__ import annotations

import itertools
import socket
import threading
import time
from array import array

import numpy as np
import pytest
import torch

from kvpool.channel import RECV_CHUNK, FastConnection, decode, encode, frame
from kvpool.errors import InvalidRequest
from kvpool.ids import pack_ids, unpack_ids
from kvpool.protocol import MAX_IDS, AllocRequest, ClaimResponse, FreeRequest


@pytest.mark.parametrize(
    "ids",
    [
        [3, 1, 2],
        (3, 1, 2),
        array("i", [3, 1, 2]),
        array("q", [3, 1, 2]),
        np.array([3, 1, 2], dtype=np.int32),
        np.array([3, 1, 2], dtype=np.int64),
        torch.tensor([3, 1, 2], dtype=torch.int32),
        torch.tensor([3, 1, 2], dtype=torch.int64),
    ],
    ids=["list", "tuple", "array-int32", "array-int64", "numpy-int32", "numpy-int64", "tensor-int32", "tensor-int64"],
)
def test_every_kind_of_id_sequence_packs_to_the_same_bytes(ids):
    packed = pack_ids(ids)
    assert packed is not None and bytes(packed) == array("q", [3, 1, 2]).tobytes()
    assert unpack_ids(packed).tolist() == [3, 1, 2]


@pytest.mark.parametrize(
    "make",
    [lambda v: array("q", v), lambda v: np.array(v, dtype=np.int64), lambda v: torch.tensor(v)],
    ids=["array", "numpy", "tensor"],
)
def test_an_int64_sequence_is_sent_without_a_copy(make):
    ids = make([5, 6])
    packed = pack_ids(ids)
    assert packed is not None
    ids[0] = 9  # the packed view is the sequence's own memory
    assert unpack_ids(packed).tolist() == [9, 6]


def test_fenced_ids_pack_whole():
    fenced = [(2**31 - 1) << 32 | 7, 1 << 32]
    packed = pack_ids(fenced)
    assert packed is not None and unpack_ids(packed).tolist() == fenced


def test_ids_outside_int64_are_left_to_json():
    assert pack_ids([1, 2**64]) is None
    assert pack_ids(["1"]) is None


def test_a_ragged_attachment_is_refused():
    with pytest.raises(InvalidRequest, match="multiple of 8"):
        unpack_ids(b"\x01\x02\x03\x04")


def test_request_with_attached_ids_parses_like_the_json_one():
    req = FreeRequest(session_id="s", block_ids=[])
    body = encode(req, pack_ids([7, 8, 9]))
    assert body.startswith(req.model_dump_json().encode() + b"\0")
    parsed, ids = decode(FreeRequest, body)
    assert parsed == FreeRequest(session_id="s", block_ids=[7, 8, 9])
    assert ids is not None and ids.tolist() == [7, 8, 9]
    plain, none = decode(FreeRequest, FreeRequest(session_id="s", block_ids=[1]).model_dump_json().encode())
    assert plain.block_ids == [1] and none is None


def test_reply_ids_come_back_both_packed_and_as_a_list():
    reply = ClaimResponse(request_id="r", block_ids=[], num_tokens=4, meta={"a": 1})
    parsed, ids = decode(ClaimResponse, encode(reply, pack_ids(array("q", [4, 2]))))
    assert parsed.block_ids == [4, 2] and ids is not None and ids.tolist() == [4, 2] and parsed.meta == {"a": 1}


def test_ids_given_twice_are_refused():
    body = encode(FreeRequest(session_id="s", block_ids=[1]), pack_ids([2]))
    with pytest.raises(InvalidRequest, match="given twice"):
        decode(FreeRequest, body)


def test_ids_attached_to_a_request_that_takes_none_are_refused():
    body = encode(AllocRequest(session_id="s", num_blocks=1), pack_ids([2]))
    with pytest.raises(InvalidRequest, match="takes no block ids"):
        decode(AllocRequest, body)


def test_more_attached_ids_than_a_call_may_carry_are_refused():
    body = encode(FreeRequest(session_id="s", block_ids=[]), pack_ids(array("q", bytes(8 * (MAX_IDS + 1)))))
    with pytest.raises(InvalidRequest, match="more than"):
        decode(FreeRequest, body)


def serve_once(path: str, replies: list[bytes], pieces: int) -> threading.Thread:
    """A stand-in pool: takes one connection, reads whatever comes, and writes ``replies`` (framed) in ``pieces``
    writes of uneven size, pausing between them so that they reach the client as separate reads."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def run() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            conn.recv(1 << 16)
            data = b"".join(frame(b"200", r) for r in replies)
            cuts = sorted({len(data) * k // pieces for k in range(1, pieces)} | {0, len(data)})
            for a, b in itertools.pairwise(cuts):
                conn.sendall(data[a:b])
                time.sleep(0.01)
            conn.recv(1)  # until the client closes

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("pieces", [1, 3, 40])
def test_replies_read_in_large_pieces_come_back_whole_and_in_order(tmp_path, pieces):
    replies = [b"a" * 10, b"b" * (3 * RECV_CHUNK + 17), b"", b"c" * 5]
    path = str(tmp_path / "s.sock")
    thread = serve_once(path, replies, pieces)
    conn = FastConnection(path, timeout_s=10)
    try:
        assert conn.call_many(b"x", [b"1", b"2", b"3", b"4"]) == [(200, r) for r in replies]
        assert not conn._buf
    finally:
        conn.close()
        thread.join(5)


def test_a_polling_read_takes_replies_that_come_while_it_polls_and_after(tmp_path):
    """Pieces 10 ms apart: the first come within the 2 ms of polling, the later ones to a read that sleeps."""
    replies = [b"a" * 10, b"b" * (2 * RECV_CHUNK + 3), b"c" * 5]
    path = str(tmp_path / "s.sock")
    thread = serve_once(path, replies, 12)
    conn = FastConnection(path, spin_s=0.002)
    try:
        assert conn.call_many(b"x", [b"1", b"2", b"3"]) == [(200, r) for r in replies]
    finally:
        conn.close()
        thread.join(5)


def test_a_connection_with_a_time_out_polls_too(tmp_path):
    """The time-out is the kernel's (SO_RCVTIMEO), so the socket stays blocking and the polling stays on."""
    replies = [b"a" * 10, b"b" * (2 * RECV_CHUNK + 3), b"c" * 5]
    path = str(tmp_path / "s.sock")
    thread = serve_once(path, replies, 12)
    conn = FastConnection(path, timeout_s=10, spin_s=0.002)
    try:
        assert conn.spin_s == 0.002 and conn.sock.gettimeout() is None
        assert conn.call_many(b"x", [b"1", b"2", b"3"]) == [(200, r) for r in replies]
    finally:
        conn.close()
        thread.join(5)


def serve_late(path: str, delay_s: float, replies: int = 1) -> threading.Thread:
    """A stand-in pool that answers each of ``replies`` requests ``delay_s`` after it came, then waits for the client
    to go (a pool that stopped answering: a delay longer than the client waits)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def run() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            for _ in range(replies):
                if not conn.recv(1 << 16):
                    return
                time.sleep(delay_s)
                try:
                    conn.sendall(frame(b"200", b"late"))
                except OSError:
                    return
            conn.recv(1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("spin_s", [0.0, 0.002])
def test_a_call_the_pool_leaves_unanswered_times_out_and_drops_the_connection(tmp_path, spin_s):
    path = str(tmp_path / "s.sock")
    thread = serve_late(path, 30.0)
    conn = FastConnection(path, timeout_s=0.5, spin_s=spin_s)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not answer within 0\.5 s"):
        conn.call(b"x", b"1")
    assert time.monotonic() - start < 0.5 + 2.0
    assert conn.closed  # its late answer can never be read as the next call's
    with pytest.raises(ConnectionError):
        conn.call(b"x", b"2")
    thread.join(0)


def test_an_answer_with_a_file_descriptor_times_out_too(tmp_path):
    path = str(tmp_path / "s.sock")
    thread = serve_late(path, 30.0)
    conn = FastConnection(path, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        conn.call_fd(b"arena_fd", b"{}", hello=b"{}")
    assert time.monotonic() - start < 0.5 + 2.0 and conn.closed
    thread.join(0)


def test_a_request_that_may_wait_in_the_pool_is_given_its_wait_on_top(tmp_path):
    """A claim waits in the pool up to its own timeout_s: its answer is read for that long beyond the time-out,
    and the next call is held to the time-out alone again."""
    path = str(tmp_path / "s.sock")
    thread = serve_late(path, 1.0, replies=2)
    conn = FastConnection(path, timeout_s=0.3)
    try:
        conn.send(b"claim", b"1", "claimed", wait_s=5.0)
        assert conn.take() == ("claimed", 200, b"late")
        with pytest.raises(TimeoutError, match=r"within 0\.3 s"):
            conn.call(b"alloc", b"2")
    finally:
        conn.close()
        thread.join(5)


def test_a_pool_whose_backlog_is_full_times_out_the_connect(tmp_path):
    """A stopped pool accepts nothing: once its listen backlog is full, a connect waits, for the time-out only."""
    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    queued = []
    try:
        for _ in range(4):  # fill the backlog (its length is the kernel's business: try until a connect would wait)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            queued.append(s)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="take the connection"):
            FastConnection(path, timeout_s=0.5)
        assert time.monotonic() - start < 0.5 + 2.0
    finally:
        for s in queued:
            s.close()
        listener.close()


def test_an_exact_read_leaves_what_follows_in_the_socket(tmp_path):
    """Before a reply that carries a file descriptor, nothing past the reply in hand may be read."""
    path = str(tmp_path / "s.sock")
    thread = serve_once(path, [b"hello", b"next"], 1)
    conn = FastConnection(path, timeout_s=10)
    try:
        conn.sock.sendall(b"go")
        assert conn.receive(exact=True) == (200, b"hello") and not conn._buf
        assert conn.sock.recv(64) == frame(b"200", b"next")
    finally:
        conn.close()
        thread.join(5)


@pytest.mark.slow
def test_batches_of_thousands_of_calls_complete_over_the_fast_channel() -> None:
    """Issue 46, finding 8: a batch sent in one write while its answers were read only after it deadlocked at about
    4,000 calls (the pool stops reading while its answers fill the socket), parking handoffs the client never learnt
    of. The batch is written while its answers are read: 4,000 commits, handoffs and claims each complete,
    and 16,000 claims of nothing each get their refusal."""
    from kvpool.client import PoolClient
    from tests.conftest import local_pool

    n = 4000
    pool = local_pool("--num-blocks", "8192", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "8",
                      "--block-size", "4", "--dtype", "float16")  # fmt: skip
    try:
        with (
            PoolClient(pool.url, name="producer", timeout_s=20) as producer,
            PoolClient(pool.url, name="consumer", timeout_s=20) as consumer,
        ):
            ids = producer.alloc(n)
            committed = producer.commit_many([([b], [i, i, i, i], 0) for i, b in enumerate(ids)])
            assert all(c is not None for c in committed)
            meta = {"note": "x" * 100}
            parked = producer.handoff_many([(f"r{i}", [b], 4, meta) for i, b in enumerate(ids)])
            assert all(p is not None for p in parked)
            claims = consumer.claim_many([f"r{i}" for i in range(n)])
            assert [c.block_ids for c in claims if c is not None] == [[b] for b in ids]
            assert consumer.claim_many([f"none-{i}" for i in range(4 * n)]) == [None] * 4 * n
    finally:
        pool.stop()
