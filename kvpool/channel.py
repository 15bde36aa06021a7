"""Framing of the fast channel (see ``server/transports/fastpath.py``), its blocking client connection, and the reply
that
carries a file descriptor (:func:`recv_frame_with_fd`; the pool sends it: ``server/transports/fdpass.py``).

A frame is ``len || head \\n body``: head is an op name in requests and a status code in replies. The body is
the request or reply model as JSON; for a model with ``block_ids`` the ids may instead follow the JSON packed as
little-endian int64 (fenced ids: see :mod:`kvpool.ids`), after a NUL byte (a JSON text never holds a raw NUL):
``{"block_ids": [], ...} \\0 ids``. The attached array replaces the empty list. Packed ids cost a memcpy where
JSON costs a parse per id (about 55 ns an id on one side with pydantic, against 15 for packing a list and nothing
for an array that is packed already), so a request's thousands of ids stay cheap on the hot path.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from array import array
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from kvpool.errors import InvalidRequest
from kvpool.ids import unpack_ids

HEADER = struct.Struct("<I")
#: the most a read takes from the socket beyond what the reply in hand needs (the replies that follow it)
RECV_CHUNK = 1 << 16
SEP = b"\0"
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


def frame(head: bytes, body: bytes) -> bytes:
    payload = b"%s\n%s" % (head, body)
    return HEADER.pack(len(payload)) + payload


def encode(model: BaseModel, ids: memoryview | None = None) -> bytes:
    """The body for ``model``; ``ids`` (packed) go attached, and ``model.block_ids`` must then be empty."""
    body = model.model_dump_json().encode()
    return body if ids is None else b"".join((body, SEP, ids))


def decode(model: type[M], body: bytes, packed: bool = False) -> tuple[M, array | None]:
    """Parse a body into ``model``; returns the attached ids too (packed), already set on ``block_ids``: as a
    list, or with ``packed`` as the array itself (for a handler that reads them once, and faster so)."""
    head, sep, tail = body.partition(SEP)
    parsed = model.model_validate_json(head)
    if not sep:
        return parsed, None
    if "block_ids" not in type(parsed).model_fields:
        raise InvalidRequest(f"{model.__name__} takes no block ids, but ids were attached")
    if parsed.block_ids:  # type: ignore[attr-defined]
        raise InvalidRequest("block ids were given twice: in the JSON and attached; attach them with block_ids []")
    ids = unpack_ids(tail)
    limit = type(parsed).model_fields["block_ids"].metadata
    most = next((m.max_length for m in limit if getattr(m, "max_length", None) is not None), None)
    if most is not None and len(ids) > most:
        raise InvalidRequest(f"{len(ids)} attached block ids, more than the {most} one call may carry")
    parsed.block_ids = ids if packed else ids.tolist()  # type: ignore[attr-defined]
    return parsed, ids


class FastConnection:
    """One kept-open Unix-socket connection, used by one thread at a time.

    Calls can be pipelined: :meth:`send` writes a request without waiting, and its reply is read, in order, before
    the next request goes out (or by :meth:`settle`). If the pool refused a pipelined request, the next call, send
    or settle raises :class:`PipelinedRefusal` instead of going on, having read every pending reply.

    Replies carry no request id: they are matched to requests by their order. So whatever interrupts an exchange
    half way (Ctrl-C, a signal handler that raises, a time-out) closes the connection: its reply, or the rest of
    it, would otherwise be read as the next call's answer. The caller opens a new one; the pool, seeing this one
    close, stops a claim that was waiting on it and parks again a handoff it took in that moment. With
    ``timeout_s``, a connect, send or read that the pool leaves waiting that long raises TimeoutError, and so
    closes the connection too.
    """

    def __init__(self, path: str, timeout_s: float | None = None, spin_s: float = 0.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(None)
        #: how long a connect, a send or a read waits for the pool (None: for ever); a read for an answer that may
        #: wait in the pool (a claim) waits that much longer
        self.timeout_s = timeout_s
        self._recv_timeout: float | None = None  # what the socket's receive time-out is set to now
        #: how long a read polls the socket before it sleeps in it
        self.spin_s = spin_s
        self.pending: deque[str] = deque()
        self._waits: deque[float] = deque()  # how long each pending request may wait in the pool
        self.closed = False
        self._buf = bytearray()  # bytes read past the reply in hand: the start of the next
        try:
            if timeout_s is not None:
                # The kernel's own time-outs (SO_SNDTIMEO, SO_RCVTIMEO) leave the socket blocking: a read costs one
                # system call, where Python's settimeout would poll(2) before each.
                _set_timeout(self.sock, socket.SO_SNDTIMEO, timeout_s)
                self._expect(0.0)
            self._timed("take the connection", self.sock.connect, path)
        except BaseException:
            self.sock.close()
            raise

    def call(self, op: bytes, body: bytes, wait_s: float = 0.0) -> tuple[int, bytes]:
        """Send a request and read its answer; ``wait_s``: how long the pool may take beyond the time-out (a
        claim's wait)."""
        self.settle()
        try:
            self._send(frame(op, body))
            self._expect(wait_s)
            return self.receive()
        except BaseException:
            self.close()
            raise

    def call_many(self, op: bytes, bodies: list[bytes], wait_s: float = 0.0) -> list[tuple[int, bytes]]:
        """Send several requests in one write and read their answers, in order: one wake-up of the pool and one
        of this thread for all of them, where :meth:`call` in a loop pays both for each."""
        self.settle()
        try:
            self._send_reading(b"".join(frame(op, body) for body in bodies), wait_s)
            self._expect(wait_s)
            return [self.receive() for _ in bodies]
        except BaseException:
            self.close()
            raise

    def call_fd(
        self, op: bytes, body: bytes, hello: bytes | None = None, meanwhile: Callable[[], object] | None = None
    ) -> tuple[int, bytes, int | None]:
        """Send a request whose answer may carry a file descriptor; returns it too (the caller closes it).

        ``hello``: on a new connection, the hello's body, sent in the same write as the request (the pool answers
        frames in order, and the request only once the hello was accepted); a refused hello is returned as the
        answer, and closes the connection. ``meanwhile`` runs once the request is sent, while the pool answers.
        """
        self.settle()
        try:
            self._send(frame(op, body) if hello is None else frame(b"hello", hello) + frame(op, body))
            if meanwhile is not None:
                meanwhile()
            self._expect(0.0)
            if hello is not None:
                status, reply = self.receive(exact=True)
                if status != 200:
                    self.close()
                    return status, reply, None
            if self._buf:
                raise ConnectionError("bytes of no request came before a reply with a file descriptor")
            payload, fd = self._timed("answer", recv_frame_with_fd, self.sock)
        except BaseException:
            self.close()
            raise
        status, _, reply = payload.partition(b"\n")
        return int(status), reply, fd

    def send(self, op: bytes, body: bytes, label: str, wait_s: float = 0.0) -> None:
        """Write a request and return at once; ``label`` names it if the pool refuses it, ``wait_s`` is how long
        the pool may take to answer it beyond the time-out (a claim's wait)."""
        self.settle()
        try:
            self._send(frame(op, body))
        except BaseException:
            self.close()
            raise
        self.pending.append(label)
        self._waits.append(wait_s)

    def settle(self) -> None:
        """Read the replies of every pipelined request; raise if the pool refused any of them."""
        refused = []
        while self.pending:
            label, status, body = self.take()
            if status != 200:
                refused.append((label, status, body))
        if refused:
            raise PipelinedRefusal(refused)

    def take(self) -> tuple[str, int, bytes]:
        """The reply of the oldest pipelined request, as (label, status, body)."""
        try:
            self._expect(self._waits[0])
            status, body = self.receive()
        except BaseException:
            self.close()
            raise
        self._waits.popleft()
        return self.pending.popleft(), status, body

    def receive(self, exact: bool = False) -> tuple[int, bytes]:
        if self.closed:
            raise ConnectionError("this fast-channel connection was closed (an earlier call was interrupted)")
        (size,) = HEADER.unpack(self._recv(HEADER.size, exact))
        status, _, reply = self._recv(size, exact).partition(b"\n")
        return int(status), reply

    def _recv(self, n: int, exact: bool = False) -> bytes:
        """``n`` bytes, read in pieces as large as the socket holds: a reply's length and body, and the replies of a
        batch, then come in one system call, and the calling thread waits for the GIL once after it instead of once
        for each (up to a switch interval each time another thread computes). ``exact``: nothing past them (a
        reply with a file descriptor may follow, and a plain read of its first byte would drop the descriptor)."""
        buf = self._buf
        while len(buf) < n:
            chunk = self._read(n - len(buf) if exact else max(RECV_CHUNK, n - len(buf)))
            if not chunk:
                raise ConnectionError("the pool closed the fast channel")
            if not buf and len(chunk) == n:
                return chunk
            buf += chunk
        with memoryview(buf) as view:
            out = bytes(view[:n])
        del buf[:n]
        return out

    def _read(self, size: int) -> bytes:
        """One read. With ``spin_s``, the socket is polled that long first: a reply that comes meanwhile costs no
        wake-up of this thread (tens of microseconds), at the price of a core and of the GIL, which the polling
        thread keeps from the process's other threads."""
        if self.spin_s:
            recv, clock = self.sock.recv, time.perf_counter
            until = clock() + self.spin_s
            while True:
                try:
                    return recv(size, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if clock() >= until:
                        break
        return self._timed("answer", self.sock.recv, size)

    def _send(self, data: bytes) -> None:
        if self.closed:
            raise ConnectionError("this fast-channel connection was closed (an earlier call was interrupted)")
        self._timed("take the request", self.sock.sendall, data)

    def _send_reading(self, data: bytes, wait_s: float) -> None:
        """Write ``data`` whole, reading the replies that come meanwhile (kept for :meth:`receive`).

        The pool answers each request before it reads the next, and stops reading while its answers fill the
        socket; a batch written whole before any answer was read then waits for ever (about 4,000 requests: the
        pool writing answers nobody reads, this thread writing requests nobody reads)."""
        if self.closed:
            raise ConnectionError("this fast-channel connection was closed (an earlier call was interrupted)")
        view = memoryview(data)
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLOUT)
        wait_ms = None if self.timeout_s is None else (self.timeout_s + wait_s) * 1000
        sent = 0
        while sent < len(view):
            try:
                sent += self.sock.send(view[sent:], socket.MSG_DONTWAIT)
                continue
            except BlockingIOError:
                pass
            events = poller.poll(wait_ms)
            if not events:
                raise TimeoutError(f"the pool did not take the request within {self.timeout_s + wait_s:g} s")
            if any(event & ~select.POLLOUT for _, event in events):
                try:
                    chunk = self.sock.recv(RECV_CHUNK, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise ConnectionError("the pool closed the fast channel")
                self._buf += chunk

    def _expect(self, wait_s: float) -> None:
        """Let the next reads wait ``wait_s`` longer than the time-out (a claim that waits in the pool)."""
        if self.timeout_s is None:
            return
        timeout = self.timeout_s + wait_s
        if timeout != self._recv_timeout:
            _set_timeout(self.sock, socket.SO_RCVTIMEO, timeout)
            self._recv_timeout = timeout

    def _timed(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the socket; the kernel's time-out, which it reports as EAGAIN, is a TimeoutError."""
        try:
            return fn(*args)
        except BlockingIOError:
            waited = self._recv_timeout if what == "answer" else self.timeout_s
            raise TimeoutError(f"the pool did not {what} within {waited:g} s") from None

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def _set_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    """A kernel time-out on a blocking socket: a read or a write (or a connect) blocked that long fails with EAGAIN."""
    whole = int(seconds)
    micro = round((seconds - whole) * 1e6)
    if whole == micro == 0:  # zero is no time-out at all
        micro = 1
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, micro))


def recv_frame_with_fd(sock: socket.socket) -> tuple[bytes, int | None]:
    """Read one frame's payload from a blocking socket, and the fd that came with it, if any."""
    fds: list[int] = []
    try:
        buf = b""
        while len(buf) < HEADER.size:
            data, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
            fds.extend(got)
            if not data:
                raise ConnectionError("the pool closed the fast channel")
            buf += data
        (size,) = HEADER.unpack(buf[: HEADER.size])
        while len(buf) < HEADER.size + size:
            data = sock.recv(HEADER.size + size - len(buf))
            if not data:
                raise ConnectionError("the pool closed the fast channel")
            buf += data
        if len(buf) > HEADER.size + size or len(fds) > 1:
            raise ConnectionError("the pool sent more than one reply and one fd: the fast channel is out of step")
    except BaseException:  # a time-out or an interruption half way, too: an fd that came is not leaked
        for fd in fds:
            os.close(fd)
        raise
    return buf[HEADER.size :], fds[0] if fds else None


class PipelinedRefusal(Exception):
    """Pipelined requests the pool refused, found before the next call was sent (that call was not sent)."""

    def __init__(self, refused: list[tuple[str, int, bytes]]) -> None:
        super().__init__(f"{len(refused)} pipelined requests refused")
        self.refused = refused
