"""What bounds the pool's connections: a cap per listener, a deadline on every request, and room under the fd limit.

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
import json
import logging
import resource
import socket
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from kvpool.errors import LimitExceeded, body_for, error_body
from kvpool.server.processes import Peer, peer_of

log = logging.getLogger("kvpool")

#: descriptors kept for what is not a client connection (the arena and host tier, inbox and slab box sockets, CUDA's
#: device files, the listeners, the event loop's own): at most half the limit, on a process allowed very few
RESERVED_FDS = 256
#: how often the refusals are logged at most (each line counts those since the last)
LOG_EVERY_S = 10.0
#: where a request's ASGI scope carries the process at the other end of its Unix-socket connection (scope["state"])
PEER = "kvpool.peer"


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
    """The HTTP listeners' caps and the read deadline, enforced by :meth:`protocol`'s connections."""

    def __init__(self, caps: dict[str, int], read_timeout_s: float, refusals: RefusalLog) -> None:
        names = {"tcp": "TCP", "unix": "HTTP Unix socket"}
        self.listeners = {kind: Listener(names[kind], cap) for kind, cap in caps.items()}
        self.read_timeout_s = read_timeout_s
        self.refusals = refusals

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
        """uvicorn's HTTP protocol (httptools where installed, else h11), with this guard in front of it."""
        guard = self

        class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
            """Admits a connection only under its listener's cap, and closes one that has not sent a whole request
            ``read_timeout_s`` after it opened, or after the first byte of its next request came.

            A request is whole once the protocol has a new request cycle (the headers are in) whose body is in too
            (``more_body`` false). Bytes that come while no request is pending start the clock, whatever they are
            (the start of the next request, or the rest of a body the app answered without reading).
            """

            _listener: Listener | None = None
            _deadline: asyncio.TimerHandle | None = None
            _armed_for: Any = None

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                listener = guard.listener(transport)
                if not listener.admit():
                    transport.write(guard.refusal(listener))  # type: ignore[attr-defined]
                    transport.close()
                    return
                self._listener = listener
                super().connection_made(transport)
                peer = peer_of(transport.get_extra_info("socket"))
                if peer is not None:  # each request's scope["state"] is a copy of this: the peer goes with it
                    self.app_state = {**self.app_state, PEER: peer}
                self._arm()

            def data_received(self, data: bytes) -> None:
                if self._listener is None:  # refused: nothing it sends is read
                    return
                if self._deadline is None:
                    self._arm()
                super().data_received(data)
                cycle = self.cycle
                whole = cycle is not None and cycle is not self._armed_for and not cycle.more_body
                if whole and self._deadline is not None:
                    self._deadline.cancel()
                    self._deadline = None

            def connection_lost(self, exc: Exception | None) -> None:
                if self._listener is None:
                    return
                self._listener.release()
                self._listener = None
                if self._deadline is not None:
                    self._deadline.cancel()
                    self._deadline = None
                super().connection_lost(exc)

            def _arm(self) -> None:
                self._armed_for = self.cycle
                loop = asyncio.get_running_loop()
                self._deadline = loop.call_later(guard.read_timeout_s, self._too_slow)

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


def request_peer(scope: dict[str, Any]) -> Peer | None:
    """The process that sent a request, where it came over the Unix socket (:class:`HTTPGuard` notes it)."""
    peer = scope.get("state", {}).get(PEER)
    return peer if isinstance(peer, Peer) else None


def _response(status: int, reason: str, body: dict[str, Any]) -> bytes:
    content = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(content)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode() + content
