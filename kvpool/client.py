"""``PoolClient``: what a worker process uses to talk to the pool and map its arena.

One client holds one session, kept alive by a background heartbeat and released on exit, one keep-alive HTTP
connection (TCP or Unix socket), and, when the pool serves it, the fast channel for the hot calls (alloc, free,
commit, lookup, handoff, claim): a kept-open Unix socket per thread that costs tens of microseconds a call
instead of an HTTP round trip. The arena is mapped once per process, whatever the number of clients.

Block ids go over the fast channel packed as int32 (see :mod:`kvpool.channel`): hand a request's block table
over as an ``array('i')``, an int32 numpy array or CPU tensor, and no id is converted on the way. A client opened
with ``inbox=True`` also receives handoffs addressed to it (``handoff(..., to=name)``) in its inbox, sent by the
pool as soon as it parked them, sealed (see :mod:`kvpool.inbox`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import httpx
from pydantic import BaseModel, ValidationError

from kvpool.arena import Arena, forget_mappings, open_arena
from kvpool.channel import SEP, FastConnection, PipelinedRefusal, decode, encode, pack_ids
from kvpool.config import default_socket
from kvpool.errors import (
    ERRORS,
    InvalidRequest,
    KvpoolError,
    PoolRestarted,
    PoolUnavailable,
    UnknownSession,
)
from kvpool.inbox import Delivery, Inbox
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
    SessionList,
    SessionRef,
    SessionSummary,
)
from kvpool.trust import check_socket

log = logging.getLogger(__name__)

R = TypeVar("R", bound=BaseModel)
T = TypeVar("T")
_BY_STATUS = {cls.status: cls for cls in reversed(list(ERRORS.values()))}
#: how long the pool holds a directly delivered claim (accept) for its handoff to be parked; it is always
#: parked already, since the pool delivers the ids only once it parked the handoff
ACCEPT_WAIT_S = 10.0
#: request ids claimed through the pool remembered, so that a late direct delivery of one is dropped
CLAIMED_KEPT = 4096
#: a HandoffRequest with its ids attached, as the direct path writes it
HANDOFF_JSON = b'{"session_id":%s,"request_id":%s,"block_ids":[],"num_tokens":%d,"meta":%s,"ttl_s":%s,"to":%s}'


def default_url() -> str:
    return os.environ.get("KVPOOL_URL") or f"unix://{default_socket()}"


def error_for(status: int, body: bytes) -> KvpoolError:
    """The exception the pool raised, from its error reply."""
    try:
        data = json.loads(body)
    except ValueError:
        data = {"detail": body.decode(errors="replace")}
    detail = data.get("detail") if isinstance(data, dict) else data
    if status == 422:
        return InvalidRequest(f"the pool refused the request: {detail}")
    name = data.get("error") if isinstance(data, dict) else None
    cls = ERRORS.get(name or "") or _BY_STATUS.get(status, KvpoolError)
    return cls(detail if isinstance(detail, str) else json.dumps(detail))


def raise_for(status: int, body: bytes) -> NoReturn:
    raise error_for(status, body)


def _as_list(ids: Sequence[int] | Any) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


class Claim:
    """A claimed handoff: its block ids packed (``ids``, int32, as they came off the wire) and as a list
    (``block_ids``, built on first use, so that a caller building a block table from ``ids`` never pays for it).

    ``direct`` is True when the ids were delivered to this client's inbox; the pool's answer to the
    claim is then still on its way (see :meth:`PoolClient.confirm`).
    """

    __slots__ = ("_list", "direct", "ids", "meta", "num_tokens", "request_id")

    def __init__(
        self,
        request_id: str,
        num_tokens: int,
        meta: dict[str, Any],
        ids: array,
        block_ids: list[int] | None = None,
        direct: bool = False,
    ) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.meta = meta
        self.ids = ids
        self._list = block_ids
        self.direct = direct

    @property
    def block_ids(self) -> list[int]:
        if self._list is None:
            self._list = self.ids.tolist()
        return self._list

    def __repr__(self) -> str:
        return (
            f"Claim(request_id={self.request_id!r}, num_tokens={self.num_tokens}, blocks={len(self.ids)}, "
            f"direct={self.direct})"
        )


def http_client(url: str, token: str | None, timeout_s: float) -> httpx.Client:
    """A client of the pool's HTTP API; for a Unix socket, only once it is known to be the pool's own
    (:func:`kvpool.trust.check_socket`): a token is never sent to a socket another user could have put there."""
    if url.startswith("unix://"):
        check_socket(url[len("unix://") :])
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
        inbox: receive the ids of handoffs addressed to this session (``handoff(..., to=name)``) in an inbox, as
            soon as the pool parked them (needs the fast channel; give the session a name no other live session has).
        spin_s: how long ``claim`` watches the inbox before it waits in the pool instead. Spinning holds a core
            but saves a wake-up (tens of microseconds); a handoff that comes later arrives through the pool.
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
        inbox: bool = False,
        spin_s: float = 0.001,
    ) -> None:
        self.url = url or default_url()
        self.name = name
        self.role: Role = role
        self.token = token if token is not None else os.environ.get("KVPOOL_TOKEN")
        self.layout = layout
        self.timeout_s = timeout_s
        self._use_fast = fast
        self._want_inbox = inbox
        self.spin_s = spin_s
        self._inbox: Inbox | None = None
        self._inbox_lock = threading.RLock()
        self._delivered: OrderedDict[str, Delivery] = OrderedDict()
        self._claimed: OrderedDict[str, None] = OrderedDict()
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
        want_inbox = self._want_inbox and self._use_fast
        req = SessionCreate(name=self.name, role=self.role, layout=self.layout, inbox=want_inbox)
        info = self._http_call("POST", "/sessions", req, SessionInfo)
        self.session_id = info.session_id
        self.epoch = info.epoch
        self.lease_ttl_s = info.lease_ttl_s
        path = info.fast_socket
        self._fast_path = path if self._use_fast and path and os.path.exists(path) else None
        self._delivered.clear()
        self._claimed.clear()
        if info.inbox is not None and self._fast_path is not None:
            try:
                key = bytes.fromhex(info.inbox_key or "")
                self._inbox = Inbox(info.inbox, self.epoch, key, os.stat(self._fast_path).st_mode & 0o777)
            except OSError as exc:  # the pool's directory is not writable from here: handoffs come through the pool
                log.warning("no inbox at %s (%s): addressed handoffs will come through the pool", info.inbox, exc)

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
            self._close_inbox()
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
        self._close_inbox()
        self._http.close()

    def _close_inbox(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
            self._inbox = None

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
        req, ids = self._with_ids(FreeRequest, block_ids, session_id=self.session_id)
        return self._call(b"free", "/free", req, FreeResponse, ids=ids).freed

    def commit(self, block_ids: Sequence[int], token_ids: Sequence[int]) -> CommitResponse:
        """Make the full blocks of ``token_ids`` findable by other sessions (call after your KV writes finished)."""
        req, ids = self._with_ids(CommitRequest, block_ids, session_id=self.session_id, token_ids=_as_list(token_ids))
        return self._call(b"commit", "/commit", req, CommitResponse, ids=ids)

    def lookup(self, token_ids: Sequence[int], device: int | None = None) -> LookupResponse:
        """The longest cached prefix of ``token_ids``; you hold a ref on each returned block until you free it."""
        req = self._req(LookupRequest, session_id=self.session_id, token_ids=_as_list(token_ids), device=device)
        return self._call(b"lookup", "/lookup", req, LookupResponse)

    def handoff(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        meta: dict[str, Any] | None = None,
        ttl_s: float | None = None,
        to: str | None = None,
    ) -> HandoffResponse:
        """Park the blocks under ``request_id`` for a consumer; your refs on them move to the handoff.

        ``to`` names the session that will claim it (and no other may). If that session has an inbox, its ids go
        there directly as soon as the pool has the handoff, and its claim returns without waiting for the pool.
        """
        if self._fast_path is not None and to is not None:
            ids = pack_ids(block_ids)
            if ids is not None:
                return self._handoff_direct(request_id, ids, num_tokens, meta or {}, ttl_s, to)
        req, ids = self._with_ids(
            HandoffRequest,
            block_ids,
            session_id=self.session_id,
            request_id=request_id,
            num_tokens=num_tokens,
            meta=meta or {},
            ttl_s=ttl_s,
            to=to,
        )
        return self._call(b"handoff", "/handoff", req, HandoffResponse, ids=ids)

    def _handoff_direct(
        self,
        request_id: str,
        ids: memoryview,
        num_tokens: int,
        meta: dict[str, Any],
        ttl_s: float | None,
        to: str,
    ) -> HandoffResponse:
        """An addressed handoff with its ids attached packed; the pool delivers them to the addressee's inbox.

        This is the direct path's critical path, so the request is written by hand and goes unvalidated: a
        pydantic model would cost more than the rest of the path. The pool validates it as any request.
        """
        try:
            extra = json.dumps(meta, separators=(",", ":")).encode()
            to_json = json.dumps(to).encode()
            ttl = b"null" if ttl_s is None else b"%r" % float(ttl_s)
            rid = json.dumps(request_id).encode()
            tokens = operator.index(num_tokens)
            head = HANDOFF_JSON % (json.dumps(self.session_id).encode(), rid, tokens, extra, ttl, to_json)
        except (TypeError, ValueError) as exc:
            why = f"{exc} (meta must be a JSON object, num_tokens an integer at least 0)"
            raise InvalidRequest(f"cannot send this handoff: {why}") from None
        return self._exchange(b"handoff", "/handoff", head, HandoffResponse, ids=ids)[0]

    def claim(self, request_id: str | None = None, timeout_s: float = 30.0) -> Claim:
        """Take a parked handoff (the oldest you may claim if ``request_id`` is None), waiting up to ``timeout_s``.

        With an inbox, a handoff delivered to it returns at once, while the pool's answer to the claim is still
        on its way: your next call to the pool (or :meth:`confirm`) raises if the pool refused it. Claiming a
        known ``request_id`` puts the claim in at the pool first and then watches the inbox, so whichever comes
        first, the ids in the inbox or the pool's answer, ends the wait.
        """
        if self._inbox is None:
            return self._claim_from_pool(request_id, timeout_s)
        if request_id is not None:
            return self._claim_expected(request_id, timeout_s)
        start = time.perf_counter()
        with self._inbox_lock:
            got = self._delivery(None, min(self.spin_s, timeout_s))
        if got is not None:
            self._pipeline(b"accept", got.request_id, ACCEPT_WAIT_S)
            return Claim(got.request_id, got.num_tokens, got.meta, got.ids, direct=True)
        return self._claim_from_pool(None, max(0.0, timeout_s - (time.perf_counter() - start)))

    def _claim_from_pool(self, request_id: str | None, timeout_s: float) -> Claim:
        req = self._req(ClaimRequest, session_id=self.session_id, request_id=request_id, timeout_s=timeout_s)
        resp, ids = self._exchange(b"claim", "/claim", req, ClaimResponse, wait_s=timeout_s)
        return self._claimed_in_pool(resp, ids)

    def _claimed_in_pool(self, resp: ClaimResponse, ids: array | None) -> Claim:
        if self._inbox is not None:
            with self._inbox_lock:
                self._delivered.pop(resp.request_id, None)
                self._claimed[resp.request_id] = None
                while len(self._claimed) > CLAIMED_KEPT:
                    self._claimed.popitem(last=False)
        packed = ids if ids is not None else array("i", resp.block_ids)
        return Claim(resp.request_id, resp.num_tokens, resp.meta, packed, resp.block_ids)

    def _claim_expected(self, request_id: str, timeout_s: float) -> Claim:
        with self._inbox_lock:
            got = self._delivered.pop(request_id, None)
            if got is None:
                conn = self._pipeline(b"claim", request_id, timeout_s)
                got = self._delivery(request_id, min(self.spin_s, timeout_s))
                if got is None:  # nothing delivered: the pool's answer to the claim has the ids
                    _, status, body = self._guard(conn.take)
                    if status != 200:
                        raise_for(status, body)
                    return self._claimed_in_pool(*decode(ClaimResponse, body))
                return Claim(request_id, got.num_tokens, got.meta, got.ids, direct=True)
        self._pipeline(b"accept", request_id, ACCEPT_WAIT_S)
        return Claim(request_id, got.num_tokens, got.meta, got.ids, direct=True)

    def confirm(self) -> None:
        """Wait for the pool's answers to this thread's direct claims; raise if it refused one (its blocks are
        then not yours). Any later call on this thread does the same first."""
        conn: FastConnection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.pending:
            self._guard(conn.settle)

    def _delivery(self, request_id: str | None, spin_s: float) -> Delivery | None:
        """A delivered handoff for this claim, from those already received or the inbox, spinning ``spin_s``."""
        assert self._inbox is not None
        until = time.perf_counter() + spin_s
        while True:
            if request_id is None:
                if self._delivered:
                    return self._delivered.popitem(last=False)[1]
            elif request_id in self._delivered:
                return self._delivered.pop(request_id)
            got = self._inbox.receive(until)
            if got is None:
                return None
            if self._claimed.pop(got.request_id, 0) is None:
                continue  # already claimed through the pool: this copy came late
            self._delivered[got.request_id] = got

    def _pipeline(self, op: bytes, request_id: str, timeout_s: float) -> FastConnection:
        """Send a claim (or an accept) of ``request_id`` without waiting for its answer; earlier answers first.

        Its body is written by hand: this is the direct path's critical path, where building and dumping a
        ClaimRequest costs more than the rest; the pool validates the body as it validates any claim.
        """
        body = b'{"session_id":%s,"request_id":%s,"timeout_s":%r}' % (
            json.dumps(self.session_id).encode(),
            json.dumps(request_id).encode(),
            float(timeout_s),
        )

        def send() -> FastConnection:
            conn = self._fast()
            conn.send(op, body, request_id)
            return conn

        return self._guard(send)

    def sessions(self, name: str | None = None) -> list[SessionSummary]:
        """The pool's live sessions (by name, role and inbox), or those called ``name``."""
        listing = self._send("GET", "/sessions", None, params={"name": name} if name is not None else None)
        return SessionList.model_validate(listing).sessions

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

    def _with_ids(self, model: type[R], block_ids: Sequence[int], **fields: Any) -> tuple[R, memoryview | None]:
        """The request, and its ids packed to go attached on the fast channel (then ``block_ids`` is empty)."""
        ids = pack_ids(block_ids) if self._fast_path is not None else None
        return self._req(model, block_ids=[] if ids is not None else _as_list(block_ids), **fields), ids

    def _call(
        self, op: bytes, path: str, req: BaseModel, resp: type[R], wait_s: float = 0.0, ids: memoryview | None = None
    ) -> R:
        return self._exchange(op, path, req, resp, wait_s, ids)[0]

    def _exchange(
        self,
        op: bytes,
        path: str,
        req: BaseModel | bytes,
        resp: type[R],
        wait_s: float = 0.0,
        ids: memoryview | None = None,
    ) -> tuple[R, array | None]:
        """One call, over the fast channel when there is one, else HTTP. Returns the answer and its block ids
        packed, if they came so. ``req`` may be the request's JSON already written (the fast channel only)."""
        if self._fast_path is None:
            assert isinstance(req, BaseModel)
            return self._guard(lambda: (self._http_call("POST", path, req, resp, wait_s), None))
        request = encode(req, ids) if isinstance(req, BaseModel) else req if ids is None else b"".join((req, SEP, ids))

        def call() -> tuple[R, array | None]:
            status, body = self._fast().call(op, request)
            if status != 200:
                raise_for(status, body)
            return decode(resp, body)

        return self._guard(call)

    def _guard(self, fn: Callable[[], T]) -> T:
        """Run a fast-channel exchange; map a lost session or a broken channel to kvpool's errors."""
        if self._lost is not None:
            raise self._lost
        try:
            return fn()
        except PipelinedRefusal as exc:
            raise self._refused(exc.refused) from None
        except UnknownSession:
            self._check_epoch()
            raise
        except (ConnectionError, OSError) as exc:
            self._close_conns()
            self._check_epoch()
            raise PoolUnavailable(f"the fast channel to the pool broke: {exc}") from exc

    @staticmethod
    def _refused(refused: list[tuple[str, int, bytes]]) -> KvpoolError:
        """The error for the direct claims the pool refused (see :meth:`confirm`); ``refused`` on it names them."""
        label, status, body = refused[0]
        exc = error_for(status, body)
        more = f" (and of {len(refused) - 1} more)" if len(refused) > 1 else ""
        err = type(exc)(
            f"the pool refused the claim of request {label!r}{more}, whose ids were delivered to your inbox: "
            f"{exc}"
        )
        err.refused = tuple(r[0] for r in refused)
        return err

    def _http_call(self, method: str, path: str, req: BaseModel | None, resp: type[R], wait_s: float = 0.0) -> R:
        return resp.model_validate(self._send(method, path, req, wait_s))

    def _send(
        self,
        method: str,
        path: str,
        req: BaseModel | None,
        wait_s: float = 0.0,
        params: dict[str, str] | None = None,
    ) -> Any:
        content = req.model_dump_json().encode() if req is not None else None
        headers = {"content-type": "application/json"} if content is not None else None
        try:
            r = self._http.request(
                method, path, content=content, headers=headers, params=params, timeout=self.timeout_s + wait_s
            )
        except httpx.HTTPError as exc:
            raise PoolUnavailable(f"cannot reach the pool at {self.url}: {exc}") from exc
        if r.status_code != 200:
            raise_for(r.status_code, r.content)
        return r.json()

    def _fast(self) -> FastConnection:
        conn: FastConnection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.closed:  # an interrupted call left it: its answers are not to be trusted
            with self._conns_lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            conn = None
        if conn is None:
            assert self._fast_path is not None
            check_socket(self._fast_path)  # the pool named it, but whoever answers hello gets the token
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

    def _global(self, ids: Sequence[int]) -> Sequence[int]:
        return [b + self.first for b in ids] if self.first else ids

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
        to: str | None = None,
    ) -> HandoffResponse:
        return self.pool.handoff(request_id, self._global(block_ids), num_tokens, meta, ttl_s, to)

    def confirm(self) -> None:
        self.pool.confirm()

    def claim(self, request_id: str | None = None, timeout_s: float = 30.0) -> Claim:
        got = self.pool.claim(request_id, timeout_s)
        ids = got.ids
        here = self.arena.descriptor.device_of(self.first)
        if ids and here is not None and self.arena.descriptor.device_of(ids[0]) != here:
            ids = array("i", self.pool.move(got.block_ids, device=here))
        elif not self.first:
            return got
        local = self._local(ids)
        return Claim(got.request_id, got.num_tokens, got.meta, array("i", local), local, got.direct)
