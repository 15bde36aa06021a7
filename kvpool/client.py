"""``PoolClient``: what a worker process uses to talk to the pool and map its arena.

One client holds one session, kept alive by a background heartbeat and released on exit, one keep-alive HTTP
connection (TCP or Unix socket), and, when the pool serves it, the fast channel for the hot calls (alloc, free,
commit, lookup, handoff, claim): a kept-open Unix socket per thread that costs tens of microseconds a call
instead of an HTTP round trip. The arena is mapped once per process, whatever the number of clients.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any, NoReturn, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from kvpool.arena import Arena, forget_mappings, open_arena
from kvpool.channel import FastConnection
from kvpool.config import default_socket
from kvpool.errors import (
    ERRORS,
    InvalidRequest,
    KvpoolError,
    PoolRestarted,
    PoolUnavailable,
    UnknownSession,
)
from kvpool.layout import KVLayout
from kvpool.protocol import (
    AllocRequest,
    AllocResponse,
    ArenaDescriptor,
    ClaimRequest,
    ClaimResponse,
    CommitRequest,
    CommitResponse,
    FreeRequest,
    FreeResponse,
    HandoffRequest,
    HandoffResponse,
    Health,
    LookupRequest,
    LookupResponse,
    Role,
    SessionCreate,
    SessionInfo,
    SessionRef,
)

log = logging.getLogger(__name__)

R = TypeVar("R", bound=BaseModel)
_BY_STATUS = {cls.status: cls for cls in reversed(list(ERRORS.values()))}


def default_url() -> str:
    return os.environ.get("KVPOOL_URL") or f"unix://{default_socket()}"


def raise_for(status: int, body: bytes) -> None:
    """Turn an error reply back into the exception the pool raised."""
    try:
        data = json.loads(body)
    except ValueError:
        data = {"detail": body.decode(errors="replace")}
    detail = data.get("detail") if isinstance(data, dict) else data
    if status == 422:
        raise InvalidRequest(f"the pool refused the request: {detail}")
    name = data.get("error") if isinstance(data, dict) else None
    cls = ERRORS.get(name or "") or _BY_STATUS.get(status, KvpoolError)
    raise cls(detail if isinstance(detail, str) else json.dumps(detail))


def http_client(url: str, token: str | None, timeout_s: float) -> httpx.Client:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    limits = httpx.Limits(max_keepalive_connections=4, keepalive_expiry=15)
    # No TLS on a Unix socket or plain http: skip building an SSL context (tens of ms per client).
    verify = url.startswith("https://")
    if url.startswith("unix://"):
        transport = httpx.HTTPTransport(uds=url[len("unix://") :], limits=limits, verify=False)
        return httpx.Client(transport=transport, base_url="http://kvpool", headers=headers, timeout=timeout_s)
    return httpx.Client(base_url=url, headers=headers, timeout=timeout_s, limits=limits, verify=verify)


class PoolClient:
    """A session with the pool.

    Args:
        url: ``unix:///path/kvpool.sock`` or ``http://127.0.0.1:8470``; default ``$KVPOOL_URL``, else the
            pool's default socket.
        name, role: how the session shows up in the pool's stats and logs.
        token: the pool's bearer token, if it has one (default ``$KVPOOL_TOKEN``).
        layout: your model's KV layout; the pool refuses a session whose layout differs from the arena's.
        fast: use the fast channel when the pool serves one and it is reachable from here.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        name: str = "client",
        role: Role = "other",
        token: str | None = None,
        layout: KVLayout | None = None,
        fast: bool = True,
        timeout_s: float = 30.0,
        heartbeat: bool = True,
    ) -> None:
        self.url = url or default_url()
        self.name = name
        self.role: Role = role
        self.token = token if token is not None else os.environ.get("KVPOOL_TOKEN")
        self.layout = layout
        self.timeout_s = timeout_s
        self._use_fast = fast
        self._http = http_client(self.url, self.token, timeout_s)
        self._local = threading.local()
        self._conns: list[FastConnection] = []
        self._conns_lock = threading.Lock()
        self._arenas: dict[int | None, Arena] = {}
        self._closed = False
        self._lost: KvpoolError | None = None
        self._session_lock = threading.Lock()  # orders reconnect() against the heartbeat marking a session lost
        self._open_session()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if heartbeat:
            self._beat = threading.Thread(target=self._heartbeat_loop, name=f"kvpool-heartbeat-{name}", daemon=True)
            self._beat.start()

    # -- session ----------------------------------------------------------------------------------------

    def _open_session(self) -> None:
        req = SessionCreate(name=self.name, role=self.role, layout=self.layout)
        info = self._http_call("POST", "/sessions", req, SessionInfo)
        self.session_id = info.session_id
        self.epoch = info.epoch
        self.lease_ttl_s = info.lease_ttl_s
        path = info.fast_socket
        self._fast_path = path if self._use_fast and path and os.path.exists(path) else None

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.lease_ttl_s / 3):
            if self._lost is not None:  # already known lost: wait for reconnect() instead of warning every beat
                continue
            session_id = self.session_id
            try:
                self._http_call("POST", f"/sessions/{session_id}/heartbeat", None, SessionInfo)
            except UnknownSession as exc:
                # Under the lock that reconnect() takes: a beat for the old session that comes back after
                # reconnect() opened a new one must not mark the new one lost.
                with self._session_lock:
                    if self.session_id != session_id:
                        continue
                    try:
                        self._check_epoch()
                        self._lost = exc
                    except PoolRestarted as restarted:
                        self._lost = restarted
                log.warning("kvpool session lost: %s", self._lost)
            except (KvpoolError, httpx.HTTPError) as exc:
                log.warning("kvpool heartbeat failed: %s", exc)

    def reconnect(self) -> None:
        """Open a new session (after the pool restarted or the lease ran out); map the arena anew on demand.

        If the pool restarted, the old arena's views are invalidated here too, even when no call noticed the
        restart first: they point at memory the new pool does not manage.
        """
        with self._session_lock:
            old_epoch = self.epoch
            self._close_conns()
            self._arenas = {}
            self._lost = None
            self._open_session()
            if self.epoch != old_epoch:
                forget_mappings(old_epoch)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=2)
        with contextlib.suppress(httpx.HTTPError):
            self._http.delete(f"/sessions/{self.session_id}")
        self._close_conns()
        self._http.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- arena ------------------------------------------------------------------------------------------

    def descriptor(self) -> ArenaDescriptor:
        return self._http_call("GET", "/arena", None, ArenaDescriptor)

    def arena(self, layout: KVLayout | None = None, device: int | None = None) -> Arena:
        """The arena mapped into this process (once per process), checked against your model's layout.

        ``device`` picks one arena of a pool that serves several GPUs (as the pool names the device).
        """
        if isinstance(self._lost, PoolRestarted):
            raise self._lost
        arena = self._arenas.get(device)
        if arena is None or arena.closed:
            descriptor = self.descriptor()
            if descriptor.epoch != self.epoch:  # restarted, and nothing noticed yet: never map it for an old session
                self._restarted(descriptor.epoch)
            arena = self._arenas[device] = open_arena(descriptor, layout or self.layout, device)
        elif layout is not None:
            open_arena(arena.descriptor, layout)
        return arena

    # -- blocks -----------------------------------------------------------------------------------------

    def alloc(self, num_blocks: int, device: int | None = None) -> list[int]:
        req = self._req(AllocRequest, session_id=self.session_id, num_blocks=num_blocks, device=device)
        return self._call(b"alloc", "/alloc", req, AllocResponse).block_ids

    def free(self, block_ids: Sequence[int]) -> int:
        req = self._req(FreeRequest, session_id=self.session_id, block_ids=list(block_ids))
        return self._call(b"free", "/free", req, FreeResponse).freed

    def commit(self, block_ids: Sequence[int], token_ids: Sequence[int]) -> CommitResponse:
        """Make the full blocks of ``token_ids`` findable by other sessions (call after your KV writes finished)."""
        req = self._req(CommitRequest, session_id=self.session_id, block_ids=list(block_ids), token_ids=list(token_ids))
        return self._call(b"commit", "/commit", req, CommitResponse)

    def lookup(self, token_ids: Sequence[int], device: int | None = None) -> LookupResponse:
        """The longest cached prefix of ``token_ids``; you hold a ref on each returned block until you free it."""
        req = self._req(LookupRequest, session_id=self.session_id, token_ids=list(token_ids), device=device)
        return self._call(b"lookup", "/lookup", req, LookupResponse)

    def handoff(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        meta: dict[str, Any] | None = None,
        ttl_s: float | None = None,
    ) -> HandoffResponse:
        req = self._req(
            HandoffRequest,
            session_id=self.session_id,
            request_id=request_id,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            meta=meta or {},
            ttl_s=ttl_s,
        )
        return self._call(b"handoff", "/handoff", req, HandoffResponse)

    def claim(self, request_id: str | None = None, timeout_s: float = 30.0) -> ClaimResponse:
        """Take a parked handoff (the oldest if ``request_id`` is None), waiting up to ``timeout_s``."""
        req = self._req(ClaimRequest, session_id=self.session_id, request_id=request_id, timeout_s=timeout_s)
        return self._call(b"claim", "/claim", req, ClaimResponse, wait_s=timeout_s)

    def move(self, block_ids: Sequence[int], device: int) -> list[int]:
        """Copy blocks you hold into new blocks on ``device``'s arena and drop your refs on the originals.

        The copy runs here, on this process's current streams (see :mod:`kvpool.transfer`), so kernels you
        launch next on ``device`` see the KV; the originals are freed only once the copy has read them.
        """
        from kvpool.transfer import copy_blocks

        if not block_ids:
            return []
        src = self.arena(device=self.arena().descriptor.device_of(block_ids[0]))
        dst = self.arena(device=device)
        new = self.alloc(len(block_ids), device=device)
        try:
            done = copy_blocks(src, block_ids, dst, new)
            if done is not None:
                done.synchronize()
        except BaseException:
            self.free(new)
            raise
        self.free(block_ids)
        return new

    def heartbeat(self) -> None:
        req = self._req(SessionRef, session_id=self.session_id)
        self._call(b"heartbeat", f"/sessions/{self.session_id}/heartbeat", req, SessionInfo)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._send("GET", "/stats", None)
        return stats

    def health(self) -> Health:
        resp = self._http.get("/health")
        return Health.model_validate_json(resp.content)

    # -- transport --------------------------------------------------------------------------------------

    @staticmethod
    def _req(model: type[R], **fields: Any) -> R:
        try:
            return model(**fields)
        except ValidationError as exc:
            raise InvalidRequest(str(exc)) from None

    def _call(self, op: bytes, path: str, req: BaseModel, resp: type[R], wait_s: float = 0.0) -> R:
        if self._lost is not None:
            raise self._lost
        try:
            if self._fast_path is None:
                return self._http_call("POST", path, req, resp, wait_s)
            status, body = self._fast().call(op, req.model_dump_json().encode())
            if status != 200:
                raise_for(status, body)
            return resp.model_validate_json(body)
        except UnknownSession:
            self._check_epoch()
            raise
        except (ConnectionError, OSError) as exc:
            self._close_conns()
            self._check_epoch()
            raise PoolUnavailable(f"the fast channel to the pool broke: {exc}") from exc

    def _http_call(self, method: str, path: str, req: BaseModel | None, resp: type[R], wait_s: float = 0.0) -> R:
        return resp.model_validate(self._send(method, path, req, wait_s))

    def _send(self, method: str, path: str, req: BaseModel | None, wait_s: float = 0.0) -> Any:
        content = req.model_dump_json().encode() if req is not None else None
        headers = {"content-type": "application/json"} if content is not None else None
        try:
            r = self._http.request(method, path, content=content, headers=headers, timeout=self.timeout_s + wait_s)
        except httpx.HTTPError as exc:
            raise PoolUnavailable(f"cannot reach the pool at {self.url}: {exc}") from exc
        if r.status_code != 200:
            raise_for(r.status_code, r.content)
        return r.json()

    def _fast(self) -> FastConnection:
        conn: FastConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            assert self._fast_path is not None
            conn = FastConnection(self._fast_path)
            body = json.dumps({"token": self.token} if self.token else {}).encode()
            status, reply = conn.call(b"hello", body)
            if status != 200:
                conn.close()
                raise_for(status, reply)
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def _close_conns(self) -> None:
        with self._conns_lock:
            for conn in self._conns:
                conn.close()
            self._conns.clear()
        self._local = threading.local()

    def _check_epoch(self) -> None:
        """After a lost session: if the pool restarted, say so and retire the old arena's views."""
        try:
            now = self.health().epoch
        except (httpx.HTTPError, ValidationError, KvpoolError):
            return
        if now != self.epoch:
            self._restarted(now)

    def _restarted(self, now: str) -> NoReturn:
        """Retire this epoch's arena views and fail every later call with PoolRestarted until reconnect()."""
        forget_mappings(self.epoch)
        self._arenas = {}
        self._lost = PoolRestarted(
            f"the pool restarted (epoch {self.epoch} -> {now}): the old arena and its blocks are gone; "
            "call reconnect() and map the arena again"
        )
        raise self._lost


class DeviceSession:
    """A session seen from one device's arena: block ids here are indices into that arena's views.

    The pool numbers blocks globally across its arenas; kernels index one arena. This view converts at the
    pool boundary, so worker code never mixes the two, and :meth:`claim` moves blocks parked on another device
    into this one (a prefill on GPU 0 handing over to a decode on GPU 1). On a single-arena pool both numberings
    are the same and every call passes straight through.
    """

    def __init__(self, pool: PoolClient, device: int | None = None, layout: KVLayout | None = None) -> None:
        self.pool = pool
        self.device = device
        self.arena = pool.arena(layout, device=device)
        self.first = self.arena.first_block

    def _global(self, ids: Sequence[int]) -> list[int]:
        return [b + self.first for b in ids] if self.first else list(ids)

    def _local(self, ids: Sequence[int]) -> list[int]:
        return self.arena.local_ids(ids)

    def alloc(self, num_blocks: int) -> list[int]:
        return self._local(self.pool.alloc(num_blocks, device=self.device))

    def free(self, block_ids: Sequence[int]) -> int:
        return self.pool.free(self._global(block_ids))

    def commit(self, block_ids: Sequence[int], token_ids: Sequence[int]) -> CommitResponse:
        return self.pool.commit(self._global(block_ids), token_ids)

    def lookup(self, token_ids: Sequence[int]) -> LookupResponse:
        hit = self.pool.lookup(token_ids, device=self.device)
        return LookupResponse(block_ids=self._local(hit.block_ids), num_tokens=hit.num_tokens)

    def handoff(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        meta: dict[str, Any] | None = None,
        ttl_s: float | None = None,
    ) -> HandoffResponse:
        return self.pool.handoff(request_id, self._global(block_ids), num_tokens, meta, ttl_s)

    def claim(self, request_id: str | None = None, timeout_s: float = 30.0) -> ClaimResponse:
        got = self.pool.claim(request_id, timeout_s)
        ids = got.block_ids
        here = self.arena.descriptor.device_of(self.first)
        if ids and here is not None and self.arena.descriptor.device_of(ids[0]) != here:
            ids = self.pool.move(ids, device=here)
        return got.model_copy(update={"block_ids": self._local(ids)})
