"""What bounds the pool's connections: a cap per listener, a deadline on every request, and room under the fd limit.

Past 400 lines on purpose: most of it is one asyncio protocol (the HTTP guard) that wraps uvicorn's whole, and
halves of it would share its state.

Any local user can reach the loopback TCP port, token or not, and uvicorn waits for ever for the rest of a request
it has the start of. Without these bounds, whoever opens connections and sends half a request line holds a file
descriptor each for as long as they like; at the process's fd limit the pool can accept nothing more, and the
token holders on the Unix socket are starved with the rest. So each listener (TCP, the HTTP Unix socket, the fast
channel) has its own cap, all of them sized under RLIMIT_NOFILE at start-up, a connection past its listener's cap
is answered 429 and closed at once, and one that sends part of a request (or nothing at all, once opened) must send
the rest within ``--read-timeout-s``. What was refused is counted (``kvpool_limits_exceeded``) and logged.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import resource
import socket
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvpool.errors import LimitExceeded, body_for, error_body
from kvpool.server.books.processes import Peer, peer_of
from kvpool.server.transports.turns import Turns

log = logging.getLogger("kvpool")

#: descriptors kept for what is not a client connection (the arena and host tier, inbox and slab box sockets, CUDA's
#: device files, the listeners, the event loop's own): at most half the limit, on a process allowed very few
RESERVED_FDS = 256
#: how often the refusals are logged at most (each line counts those since the last)
LOG_EVERY_S = 10.0
#: where a request's ASGI scope carries the process at the other end of its Unix-socket connection (scope["state"])
PEER = "kvpool.peer"
#: the most an HTTP connection reads at a time, and holds unparsed
READ_BYTES = 16 << 10
#: the longest request head (request line and headers) the pool reads
MAX_HEAD = 16 << 10
#: the answers an HTTP connection buffers for a client that does not read them, before its request waits
WRITE_BYTES = 16 << 10


def open_files_limit() -> int:
    """The process's fd limit, its soft limit first raised to the hard one (which needs no privilege)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    most = hard if hard != resource.RLIM_INFINITY else _nr_open()
    if soft == resource.RLIM_INFINITY:
        return most
    if soft < most:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (most, hard))
            soft = most
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open files limit from %d to %d: %s", soft, most, exc)
    return soft


def _nr_open() -> int:
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return 1 << 20


def size_caps(wanted: dict[str, int], limit: int) -> dict[str, int]:
    """Each listener's connection cap, shrunk in proportion where together they would not fit under ``limit``
    with room kept for everything else; one more connection than that would fail some other open, or accept."""
    room = limit - min(RESERVED_FDS, limit // 2)
    total = sum(wanted.values())
    if total <= room:
        return dict(wanted)
    caps = {name: max(1, cap * room // total) for name, cap in wanted.items()}
    log.warning(
        "the pool may open %d files (RLIMIT_NOFILE): connections capped at %s instead of %s, keeping %d for the "
        "arena, files and sockets; raise the limit (ulimit -n, a container's nofile limit) to serve more",
        limit,
        _shown(caps),
        _shown(wanted),
        limit - room,
    )
    return caps


def _shown(caps: dict[str, int]) -> str:
    return ", ".join(f"{name} {cap}" for name, cap in caps.items())


class RefusalLog:
    """What the pool refused or cut off, each counted at once and logged as a warning: the first of a kind at
    once, then at most one line per kind every :data:`LOG_EVERY_S`, with how many since the last (a thousand in a
    second make two lines, not a thousand)."""

    def __init__(self, count: Callable[[str], None], every_s: float = LOG_EVERY_S) -> None:
        self.count = count
        self.every_s = every_s
        self.pending: Counter[str] = Counter()
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._logged: dict[str, float] = {}

    def note(self, limit: str, what: str) -> None:
        """Count a refusal for the setting ``limit``, and log ``what`` was refused."""
        self.count(limit)
        self.pending[what] += 1
        if what not in self._timers:
            loop = asyncio.get_running_loop()
            last = self._logged.get(what, -self.every_s)
            self._timers[what] = loop.call_later(max(0.0, last + self.every_s - loop.time()), self._flush, what)

    def _flush(self, what: str) -> None:
        del self._timers[what]
        self._logged[what] = asyncio.get_running_loop().time()
        log.warning("refused or closed %d %s", self.pending.pop(what, 0), what)


class Listener:
    """One listener's connections: how many are open, and the cap they may not pass."""

    def __init__(self, name: str, cap: int) -> None:
        self.name = name
        self.cap = cap
        self.open = 0

    def admit(self) -> bool:
        if self.open >= self.cap:
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1


class HTTPGuard:
    """The HTTP listeners' caps, the read deadline and the peers' turns, enforced by :meth:`protocol`'s
    connections."""

    def __init__(
        self,
        caps: dict[str, int],
        read_timeout_s: float,
        refusals: RefusalLog,
        requests_per_peer: int = 1,
        token: bytes | None = None,
    ) -> None:
        names = {"tcp": "TCP", "unix": "HTTP Unix socket"}
        self.listeners = {kind: Listener(names[kind], cap) for kind, cap in caps.items()}
        self.read_timeout_s = read_timeout_s
        self.refusals = refusals
        self.turns = Turns(requests_per_peer)
        self.token = token

    def shows_token(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether a request's head carries the pool's token (every request does, where the pool has none): what
        schedules its connection, not what admits it (the app checks the token itself: ``gates.RequireToken``)."""
        if self.token is None:
            return True
        given = b""
        for name, value in headers:
            if name == b"authorization":
                given = value
        scheme, _, value = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(value, self.token)

    def listener(self, transport: asyncio.BaseTransport) -> Listener:
        sock = transport.get_extra_info("socket")
        return self.listeners["unix" if sock is not None and sock.family == socket.AF_UNIX else "tcp"]

    def refusal(self, listener: Listener) -> bytes:
        """The answer to a connection past its listener's cap: written before anything was read, then closed."""
        self.refusals.note(
            "max_http_connections", f"{listener.name} connections past --max-http-connections {listener.cap}"
        )
        exc = LimitExceeded(
            f"the pool's {listener.name} has {listener.open} connections open, its limit (--max-http-connections, "
            "KVPOOL_MAX_HTTP_CONNECTIONS): close idle clients, reach the pool over its Unix socket, or raise it"
        )
        return _response(429, "Too Many Requests", body_for(exc))

    def timed_out(self, listener: Listener) -> bytes:
        """The answer (where one can still go) to a connection that sent no whole request within the deadline."""
        self.refusals.note(
            "read_timeout_s",
            f"{listener.name} connections that sent no whole request within --read-timeout-s {self.read_timeout_s:g}",
        )
        detail = (
            f"no whole request within {self.read_timeout_s:g} s (--read-timeout-s, KVPOOL_READ_TIMEOUT_S): "
            "send each request at once, or raise it"
        )
        return _response(408, "Request Timeout", error_body(detail, "KvpoolError"))

    def protocol(self) -> type[asyncio.Protocol]:
        """uvicorn's httptools HTTP protocol, with this guard in front of it."""
        return _guarded(self)


def _guarded(guard: HTTPGuard) -> type[asyncio.Protocol]:
    read_buffer = memoryview(bytearray(READ_BYTES))  # one for all: each read is handed on before the next starts

    class GuardedHTTPProtocol(HttpToolsProtocol, asyncio.BufferedProtocol):  # type: ignore[misc]
        """Admits a connection only under its listener's cap; reads at most :data:`READ_BYTES` at a time and
        nothing more while it holds bytes it has not parsed; parses one request at a time, and only with one of its
        peer's turns (:mod:`kvpool.server.transports.turns`); closes a connection whose client owes the rest of a
        request (or
        its first one) ``read_timeout_s`` after it started owing it.

        So a connection holds at most one request parsed, one read's bytes unparsed and one request head of
        :data:`MAX_HEAD` bytes, however many requests it pipelines; a request waiting for a turn or for its answer
        to be read is the pool's wait, not the client's, and runs no deadline.
        """

        _listener: Listener | None = None
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            listener = guard.listener(transport)
            if not listener.admit():
                transport.write(guard.refusal(listener))  # type: ignore[attr-defined]
                transport.close()
                return
            self._listener = listener
            self._held = bytearray()
            self._turn = False  # holds one of its peer's turns
            self._turn_since = 0.0  # since when (time.monotonic)
            self._trusted = False  # the request being read showed the token: its bytes need no turn
            self._between = True  # the parser is between requests
            self._fresh = True  # nothing read yet: the client owes its first request
            self._head = 0  # bytes of the request's head given to the parser, while it is in the head (else -1)
            self._tail = b""  # the last bytes of the head given to the parser: its end may come in the next read
            self._body_left: int | None = None  # bytes of a content-length body still to give to the parser
            peer = peer_of(transport.get_extra_info("socket"), transport.get_extra_info("peername"))
            self._key = peer.share if peer is not None else "unknown"
            self._peer = guard.turns.join(self._key)
            super().connection_made(transport)  # type: ignore[arg-type]
            if peer is not None:  # each request's scope["state"] is a copy of this: the peer goes with it
                self.app_state = {**self.app_state, PEER: peer}
            transport.set_write_buffer_limits(high=WRITE_BYTES)  # type: ignore[attr-defined]
            self.flow = _HeldFlow(transport)  # type: ignore[arg-type]
            self._clock()

        def get_buffer(self, sizehint: int) -> memoryview:
            return read_buffer

        def buffer_updated(self, nbytes: int) -> None:
            self.data_received(bytes(read_buffer[:nbytes]))

        def data_received(self, data: bytes) -> None:
            if self._listener is None:  # refused: nothing it sends is read
                return
            self._held += data
            self._fresh = False
            self._pump()

        def granted(self) -> None:
            """One of the peer's turns, handed on by a connection that gave it back."""
            if self._listener is None:
                self._peer.give()
                return
            self._turn = True
            self._turn_since = time.monotonic()
            self._pump()

        def _pump(self) -> None:
            """Give the parser what it may have: all of one request, with a turn, and nothing of the next while
            this one is being answered."""
            held = self._held
            while held and not self.transport.is_closing():
                cycle = self.cycle
                if self._between and cycle is not None and not cycle.response_complete:
                    break  # answering: the next request waits unparsed
                if not self._turn and not self._trusted:
                    if not self._peer.take(self):
                        break
                    self._turn = True
                    self._turn_since = time.monotonic()
                n = self._slice()
                if n is None:
                    self._refuse_head()
                    return
                chunk = bytes(held[:n])
                del held[:n]
                if self._between:
                    self._between, self._head, self._tail = False, 0, b""
                if self._body_left is not None:
                    self._body_left -= n
                elif self._head >= 0:
                    self._head += n
                    self._tail = (self._tail + chunk)[-3:]
                super().data_received(chunk)
            if self.transport.is_closing():
                held.clear()
            cycle = self.cycle
            if not (self._between and cycle is not None and not cycle.response_complete):
                self._give_turn()  # nothing to answer: the rest of a request, or the next, is the client's to send
            self.flow.hold(bool(held))
            self._clock()

        def _slice(self) -> int | None:
            """How much of the held bytes the parser gets next: up to the end of a head, or of a body of known
            length, so that it never sees the next request; None for a head that grows past :data:`MAX_HEAD`."""
            held = self._held
            if self._body_left is not None:
                return min(self._body_left, len(held))
            if self._head >= 0 and self._tail:
                joint = (self._tail + held[:3]).find(b"\r\n\r\n")
                if joint >= 0:
                    return joint + 4 - len(self._tail)
            end = held.find(b"\r\n\r\n")
            if end >= 0:
                return end + 4
            if self._head >= 0 and self._head + len(held) > MAX_HEAD:
                return None
            return len(held)

        def on_headers_complete(self) -> None:
            self._head = -1  # in the body now
            super().on_headers_complete()
            self._body_left = _content_length(self.headers)
            if guard.shows_token(self.headers):
                self._trusted = True  # what is left of it, and its answer, take no turn
                self._give_turn()

        def on_message_complete(self) -> None:
            self._between, self._trusted, self._body_left = True, False, None
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self._trusted = False
            self._give_turn()
            super().on_response_complete()
            self._pump()

        def pause_writing(self) -> None:
            self._give_turn()  # its client reads no answer: it costs the loop nothing until it does
            super().pause_writing()

        def _give_turn(self) -> None:
            if self._turn:
                self._turn = False
                self._peer.give(time.monotonic() - self._turn_since)

        def _refuse_head(self) -> None:
            guard.refusals.note("max_http_head", f"HTTP request heads over {MAX_HEAD} bytes")
            detail = f"request head (request line and headers) over {MAX_HEAD} bytes"
            self.transport.write(_response(431, "Request Header Fields Too Large", error_body(detail, "KvpoolError")))
            self.transport.close()
            self._held.clear()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._listener is None:
                return
            self._listener.release()
            self._listener = None
            self._held.clear()
            self._give_turn()
            self._peer.forget(self)
            guard.turns.leave(self._key, self._peer)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None
            super().connection_lost(exc)

        def _clock(self) -> None:
            """Run the read deadline while the client owes bytes: its first request, or the rest of one."""
            owes = (self._fresh or not self._between) and not self._held
            if owes and self._deadline is None:
                self._deadline = asyncio.get_running_loop().call_later(guard.read_timeout_s, self._too_slow)
            elif not owes and self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self._listener is None or self.transport.is_closing():
                return
            answer = guard.timed_out(self._listener)
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # no app is answering on this connection
                self.transport.write(answer)
            self.transport.close()

    return GuardedHTTPProtocol


class _HeldFlow(FlowControl):
    """uvicorn's flow control, but reading stays paused while the connection holds bytes it has not parsed."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self._wanted = False  # uvicorn's own pause (a body its app has not read yet)
        self._held = False

    def pause_reading(self) -> None:
        self._wanted = True
        self._apply()

    def resume_reading(self) -> None:
        self._wanted = False
        self._apply()

    def hold(self, held: bool) -> None:
        self._held = held
        self._apply()

    def _apply(self) -> None:
        paused = self._wanted or self._held
        if paused and not self.read_paused:
            self.read_paused = True
            self._transport.pause_reading()
        elif not paused and self.read_paused:
            self.read_paused = False
            self._transport.resume_reading()


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """A request body's length as its head gives it; None for a chunked body (or one with no length)."""
    length = None
    for name, value in headers:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length" and value.strip().isdigit():
            length = int(value)
    return length


def request_peer(scope: dict[str, Any]) -> Peer | None:
    """Who sent a request: its process and user over the Unix socket, its address over TCP (:class:`HTTPGuard` notes
    it)."""
    peer = scope.get("state", {}).get(PEER)
    return peer if isinstance(peer, Peer) else None


def _response(status: int, reason: str, body: dict[str, Any]) -> bytes:
    content = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(content)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + content
