"""How a client reaches the pool: HTTP for everything, and the fast channel for the hot calls.

HTTP goes over one keep-alive connection (TCP or the pool's Unix socket). The fast channel, when the pool serves
one, is a kept-open Unix socket per thread that costs tens of microseconds a call instead of an HTTP round trip,
with block ids packed as int64 both ways (see :mod:`kvpool.channel`). Callers name a call by its route
(:mod:`kvpool.routes`) and :meth:`Transport.call` picks the way, so they never depend on which one carried it. A
pool served in this process (a test's) is reached at ``local://NAME``: its HTTP calls run on its own event loop
without a socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
from array import array
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import httpx
from pydantic import BaseModel

from kvpool.channel import SEP, FastConnection, decode, encode
from kvpool.errors import InvalidRequest, KvpoolError, PoolTimeout, PoolUnavailable, error_for, raise_for
from kvpool.ids import pack_ids
from kvpool.routes import Route
from kvpool.trust import check_socket

R = TypeVar("R", bound=BaseModel)
RAISE_TIMEOUT = "give PoolClient a larger timeout_s if the pool is only slow"
LOCAL = "local://"


class LocalTransport(httpx.BaseTransport):
    """HTTP to an ASGI app served on an event loop of this process, with no socket between: a test's pool runs in
    the test's own process and starts in milliseconds. Each request runs on the app's loop as uvicorn would run it, so
    a claim that waits there holds back no other call."""

    #: the apps served so in this process, by the name in their ``local://NAME`` url
    served: ClassVar[dict[str, LocalTransport]] = {}

    def __init__(self, name: str, app: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.name = name
        self.loop = loop
        self._asgi = httpx.ASGITransport(app)
        self._calls: set[concurrent.futures.Future[tuple[int, httpx.Headers, bytes]]] = set()

    @property
    def url(self) -> str:
        return LOCAL + self.name

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def one() -> tuple[int, httpx.Headers, bytes]:
            response = await self._asgi.handle_async_request(request)
            return response.status_code, response.headers, await response.aread()

        if self.loop.is_closed():
            raise httpx.ConnectError(f"the pool {self.url} was stopped", request=request)
        answer = asyncio.run_coroutine_threadsafe(one(), self.loop)
        self._calls.add(answer)
        try:
            status, headers, body = answer.result(request.extensions.get("timeout", {}).get("read"))
        except concurrent.futures.TimeoutError:
            answer.cancel()
            raise httpx.ReadTimeout(f"no answer from {self.url}", request=request) from None
        except concurrent.futures.CancelledError:
            raise httpx.ConnectError(f"the pool {self.url} stopped during the call", request=request) from None
        finally:
            self._calls.discard(answer)
        return httpx.Response(status, headers=headers, content=body, request=request)

    def drain(self, timeout_s: float) -> None:
        """Let the calls in flight finish (a stopping pool answers its waiting claims first), as uvicorn's graceful
        shutdown does; cut off the rest, whose callers then learn that the pool stopped."""
        _, left = concurrent.futures.wait(list(self._calls), timeout_s)
        for call in left:
            call.cancel()


def http_client(url: str, token: str | None, timeout_s: float) -> httpx.Client:
    """A client of the pool's HTTP API; for a Unix socket, only once it is known to be the pool's own
    (:func:`kvpool.trust.check_socket`): a token is never sent to a socket another user could have put there."""
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if url.startswith(LOCAL):
        local = LocalTransport.served.get(url[len(LOCAL) :])
        if local is None:
            raise PoolUnavailable(f"no pool is served in this process at {url}: start it, or name a pool's socket")
        return httpx.Client(transport=local, base_url="http://kvpool", headers=headers, timeout=timeout_s)
    if url.startswith("unix://"):
        check_socket(url[len("unix://") :])
    limits = httpx.Limits(max_keepalive_connections=4, keepalive_expiry=15)
    # No TLS on a Unix socket or plain http: skip building an SSL context (tens of ms per client).
    verify = url.startswith("https://")
    if url.startswith("unix://"):
        transport = httpx.HTTPTransport(uds=url[len("unix://") :], limits=limits, verify=False)
        return httpx.Client(transport=transport, base_url="http://kvpool", headers=headers, timeout=timeout_s)
    return httpx.Client(base_url=url, headers=headers, timeout=timeout_s, limits=limits, verify=verify)


def reply_spin(value: float | None) -> float:
    """A client's ``reply_spin_s``, or else ``KVPOOL_REPLY_SPIN_US`` (microseconds; unset or 0: no polling)."""
    if value is None:
        raw = os.environ.get("KVPOOL_REPLY_SPIN_US") or "0"
        try:
            value = float(raw) / 1e6
        except ValueError:
            raise InvalidRequest(f"KVPOOL_REPLY_SPIN_US must be a number of microseconds, got {raw!r}") from None
    if not 0 <= value < 1:
        raise InvalidRequest(f"a reply spin must be at least 0 and under a second, got {value} s")
    return value


class Transport:
    """One client's ways to the pool; ``fast_path`` is set once the pool has named its fast channel and the client
    may use it (:meth:`use_fast`)."""

    def __init__(self, url: str, token: str | None, timeout_s: float, reply_spin_s: float = 0.0) -> None:
        self.url = url
        self.token = token
        self.timeout_s = timeout_s
        self.reply_spin_s = reply_spin_s
        self.http = http_client(url, token, timeout_s)
        self.fast_path: str | None = None
        self._local = threading.local()
        self._conns: list[FastConnection] = []
        self._conns_lock = threading.Lock()

    def use_fast(self, path: str | None) -> str | None:
        """Carry the calls that have a fast op over the fast channel at ``path`` (None: over HTTP), if it is there;
        the path taken."""
        self.fast_path = path if path and os.path.exists(path) else None
        return self.fast_path

    def fast_mode(self) -> int:
        """The permission bits of the fast channel's socket (0600 without one): what sockets this client binds
        for the pool's peers to reach (an inbox, a slab box) get the same."""
        return os.stat(self.fast_path).st_mode & 0o777 if self.fast_path is not None else 0o600

    def goes_fast(self, route: Route) -> bool:
        return route.fast is not None and self.fast_path is not None

    def attach(self, route: Route, block_ids: Any) -> memoryview | None:
        """``block_ids`` packed to go attached to ``route``'s request, where it goes over the fast channel (then the
        request's own ``block_ids`` is empty); None: they go in the request."""
        return pack_ids(block_ids) if self.goes_fast(route) else None

    def request(
        self,
        method: str,
        path: str,
        req: BaseModel | None = None,
        wait_s: float = 0.0,
        params: dict[str, str] | None = None,
    ) -> Any:
        """One HTTP call; the answer's JSON, or the pool's refusal raised as kvpool's exception."""
        content = req.model_dump_json().encode() if req is not None else None
        headers = {"content-type": "application/json"} if content is not None else None
        try:
            r = self.http.request(
                method, path, content=content, headers=headers, params=params, timeout=self.timeout_s + wait_s
            )
        except httpx.TimeoutException as exc:
            raise PoolTimeout(
                f"the pool at {self.url} did not answer {method} {path} within {self.timeout_s + wait_s:g} s ({exc}): "
                f"it may be stopped or overloaded, and the call may or may not have taken effect; {RAISE_TIMEOUT}"
            ) from exc
        except httpx.HTTPError as exc:
            raise PoolUnavailable(f"cannot reach the pool at {self.url}: {exc}") from exc
        if r.status_code != 200:
            raise_for(r.status_code, r.content)
        return r.json()

    def fetch(
        self, route: Route, req: BaseModel | None = None, wait_s: float = 0.0, session_id: str | None = None
    ) -> Any:
        """``route``'s call over HTTP, whatever its fast op: the answer as its response model. (A thread that must
        hold no fast connection of its own, the heartbeat's, calls so.) ``session_id``: the path's, if it has one
        (else the request's)."""
        assert route.response is not None, f"{route.name} answers no model"
        path = route.url(session_id or getattr(req, "session_id", None))
        return route.response.model_validate(self.request(route.method, path, req, wait_s))

    def call(
        self, route: Route, req: BaseModel | bytes, wait_s: float = 0.0, ids: memoryview | None = None
    ) -> tuple[Any, array | None]:
        """One call, over the fast channel where ``route`` has an op on it and the pool serves one, else HTTP.
        Returns the answer (``route``'s response model) and its block ids packed, if they came so. ``req`` may be
        the request's JSON already written, and ``ids`` attached: then only over the fast channel."""
        if route.fast is None or self.fast_path is None:
            assert isinstance(req, BaseModel) and ids is None
            return self.fetch(route, req, wait_s), None
        request = encode(req, ids) if isinstance(req, BaseModel) else req if ids is None else b"".join((req, SEP, ids))
        status, body = self.exchange(lambda conn: conn.call(route.fast, request, wait_s))
        if status != 200:
            raise_for(status, body)
        return decode(route.response, body)

    def call_many(
        self, route: Route, reqs: list[BaseModel], wait_s: float = 0.0
    ) -> list[tuple[Any, array | None] | KvpoolError]:
        """Several calls of one route, in order: over the fast channel all sent in one write, over HTTP one after
        the other. A call the pool refused gives its error in its place; the others stand."""
        if route.fast is None or self.fast_path is None:
            out: list[tuple[Any, array | None] | KvpoolError] = []
            for req in reqs:
                try:
                    out.append((self.fetch(route, req, wait_s), None))
                except KvpoolError as exc:
                    if isinstance(exc, PoolUnavailable):
                        raise
                    out.append(exc)
            return out
        replies = self.exchange(lambda conn: conn.call_many(route.fast, [encode(req) for req in reqs], wait_s))
        return [decode(route.response, body) if status == 200 else error_for(status, body) for status, body in replies]

    def exchange(self, fn: Callable[[FastConnection], Any]) -> Any:
        """Run ``fn`` on this thread's fast connection; a broken channel is PoolUnavailable, and every thread opens
        a new connection next; a pool that leaves it waiting past ``timeout_s`` is PoolTimeout, and this thread
        opens a new one next. (A connection interrupted mid-exchange closes itself: see FastConnection.)"""
        try:
            return fn(self.connection())
        except TimeoutError as exc:
            raise self._timed_out(exc) from exc
        except (ConnectionError, OSError) as exc:
            self.reset()
            raise PoolUnavailable(f"the fast channel to the pool broke: {exc}") from exc

    def pending(self) -> FastConnection | None:
        """This thread's fast connection if it has pipelined requests whose answers are not read yet."""
        conn: FastConnection | None = getattr(self._local, "conn", None)
        return conn if conn is not None and conn.pending else None

    def connection(self) -> FastConnection:
        conn = self._held()
        if conn is None:
            assert self.fast_path is not None
            conn = self._hold(self._open(self.fast_path))
        return conn

    def _held(self) -> FastConnection | None:
        """This thread's fast connection, unless an interrupted call closed it (its answers are not to be trusted)."""
        conn: FastConnection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.closed:
            with self._conns_lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            conn = None
        return conn

    def _hold(self, conn: FastConnection) -> FastConnection:
        self._local.conn = conn
        with self._conns_lock:
            self._conns.append(conn)
        return conn

    def _connect(self, path: str) -> FastConnection:
        check_socket(path)  # the pool named it, but whoever answers hello gets the token
        try:
            return FastConnection(path, self.timeout_s, self.reply_spin_s)
        except TimeoutError as exc:
            raise self._timed_out(exc, path) from exc
        except OSError as exc:
            raise PoolUnavailable(f"cannot reach the pool's fast channel at {path}: {exc}") from exc

    def _hello(self) -> bytes:
        return json.dumps({"token": self.token} if self.token else {}).encode()

    def _open(self, path: str) -> FastConnection:
        """A fast-channel connection that said hello (with the token, if any) and was answered 200."""
        conn = self._connect(path)
        status, reply = conn.call(b"hello", self._hello())
        if status != 200:
            conn.close()
            raise_for(status, reply)
        return conn

    def call_fd(self, route: Route, req: BaseModel, path: str) -> int:
        """A fast-channel call answered with a file descriptor; over a connection of its own when the client
        does not use the fast channel for its other calls."""
        return self.fetch_fd(route, req, path)[1]

    def fetch_fd(
        self, route: Route, req: BaseModel, path: str, meanwhile: Callable[[], object] | None = None
    ) -> tuple[bytes, int]:
        """:meth:`call_fd`, with the answer's JSON body too. A new connection's hello goes in the same write as
        the request: one round trip where a worker's first arena took two. ``meanwhile`` runs while the pool
        answers."""
        op = route.fast
        assert op is not None, f"{route.name} is no call of the fast channel"
        body = req.model_dump_json().encode()
        if self.fast_path is not None and self._held() is not None:
            status, reply, fd = self.exchange(lambda conn: conn.call_fd(op, body, meanwhile=meanwhile))
        else:
            conn = self._connect(self.fast_path or path)
            try:
                status, reply, fd = conn.call_fd(op, body, hello=self._hello(), meanwhile=meanwhile)
            except TimeoutError as exc:
                raise self._timed_out(exc, self.fast_path or path) from exc
            except (ConnectionError, OSError) as exc:
                conn.close()
                raise PoolUnavailable(f"the fast channel to the pool broke: {exc}") from exc
            if self.fast_path is not None and not conn.closed:
                self._hold(conn)
            else:
                conn.close()
        if status != 200:
            if fd is not None:
                os.close(fd)
            raise_for(status, reply)
        if fd is None:
            raise PoolUnavailable(f"the pool answered {op.decode()} without a file descriptor: is it a kvpool pool?")
        return reply, fd

    def _timed_out(self, exc: TimeoutError, path: str | None = None) -> PoolTimeout:
        return PoolTimeout(
            f"{exc} over its fast channel ({path or self.fast_path}): it may be stopped or overloaded, and the call "
            f"may or may not have taken effect. This thread's connection was dropped (the next call opens a new one); "
            f"{RAISE_TIMEOUT}"
        )

    def reset(self) -> None:
        """Close every thread's fast connection; each opens a new one on its next call."""
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        self._local = threading.local()

    def close(self) -> None:
        self.reset()
        self.http.close()
