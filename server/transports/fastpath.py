"""The fast channel: the control plane's hot calls over a Unix socket, without HTTP.

Past 400 lines on purpose: the listener, each connection's bounds and its frame reader are one state machine per
connection.

An HTTP round trip through an ASGI framework costs about a millisecond, more than moving a gigabyte of KV on
the GPU; a length-prefixed frame on a kept-open Unix socket costs tens of microseconds. The channel carries
the same calls with the same pydantic models and the same errors as the HTTP API, and ownership still moves
in the same books, so a crash loses nothing. ``/claim`` waits are pushed: the claimer's reply goes out as
soon as the handoff is parked.

Frame: a 4-byte little-endian length, then ``op\\n`` and a JSON body, with block ids attached packed (see
:mod:`kvpool.channel`). Reply: the same framing, with ``status\\n``. The first frame of a connection is ``hello``
(with the token, if the pool has one). ``accept`` is ``claim`` for a claimer that already holds the ids (its
producer delivered them to its inbox): the answer leaves them out. ``arena_fd`` answers a live session that said
hello with a VMM arena's file descriptor attached to the reply (SCM_RIGHTS).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from kvpool.channel import HEADER, decode, encode, frame
from kvpool.errors import KvpoolError, LimitExceeded, PayloadTooLarge, Unauthorized, body_for, error_body
from kvpool.ids import pack_ids
from kvpool.protocol import ArenaFdRequest, Hello
from kvpool.routes import (
    ACCEPT,
    ALLOC,
    ARENA_FD,
    CLAIM,
    COMMIT,
    FREE,
    HANDOFF,
    HEARTBEAT,
    HELLO,
    LOOKUP,
    LOOKUPS,
    Route,
)
from kvpool.server.books.processes import Peer, peer_of
from kvpool.server.plane import ControlPlane
from kvpool.server.transports.connections import RefusalLog
from kvpool.server.transports.fdpass import send_with_fd

log = logging.getLogger(__name__)

Handler = Callable[[Any], Any]
#: the largest frame taken before a connection's hello (a hello is a token, at most 4096 characters, in JSON):
#: a stranger holds no more memory than this, and no longer than the hello time-out
HELLO_MAX = 16 << 10
#: ops that may wait: they stop waiting when their connection closes
WAITS = frozenset({CLAIM.fast, ACCEPT.fast})
#: ops whose handler also takes the connection's peer (a session opened over TCP takes the process that renews it)
PEERED = frozenset({HEARTBEAT.fast})
#: ops whose handler takes attached ids as they came (an ``array('q')``): the books unfence them without a list
PACKED = frozenset({FREE.fast})
#: ops the connection answers itself, before (hello) or beside (an fd attached) the control plane's handlers
OWN = (HELLO, ARENA_FD)


def _encode(status: int, body: bytes) -> bytes:
    return frame(b"%d" % status, body)


def _error(exc: KvpoolError) -> bytes:
    return _encode(exc.status, json.dumps(body_for(exc)).encode())


class FastChannel:
    """The fast channel's listener and connections.

    Each connection is bounded: before its hello it may send frames of :data:`HELLO_MAX` bytes at most, and must
    have said hello within ``hello_timeout_s`` of opening; after it, a frame it has started must come whole within
    ``read_timeout_s`` (an idle connection between frames waits for ever: clients keep theirs open), and the bytes
    of frames being read or answered, all connections together, at most ``max_buffered``, counted as they come.

    The read deadline is kept by a sweep every quarter of it, not a timer per frame: arming and cancelling one costs
    about as much as the rest of the channel's own work on a call.
    """

    def __init__(
        self,
        plane: ControlPlane,
        path: Path,
        mode: int,
        max_frame: int,
        max_connections: int = 4096,
        hello_timeout_s: float = 10.0,
        read_timeout_s: float = 10.0,
        max_buffered: int | None = None,
        refusals: RefusalLog | None = None,
    ) -> None:
        self.plane = plane
        self.path = path
        self.mode = mode
        self.max_frame = max_frame
        self.max_connections = max_connections
        self.hello_timeout_s = hello_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_buffered = max_buffered if max_buffered is not None else 16 * max_frame
        self.refusals = refusals if refusals is not None else RefusalLog(plane.count_exceeded)
        self.connections = 0
        self.buffered = 0  # bytes of the frames being read or answered after hello, all connections together
        token = plane.settings.token
        self.token = token.get_secret_value().encode() if token else None
        self._server: asyncio.AbstractServer | None = None
        self._open: set[_Reading] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._serving: dict[asyncio.Task[None], asyncio.StreamWriter] = {}  # connections being served, closed at stop
        handlers: dict[Route, Handler] = {
            ALLOC: plane.alloc,
            FREE: plane.free,
            COMMIT: plane.commit,
            LOOKUP: plane.lookup,
            LOOKUPS: plane.lookup_many,
            HANDOFF: plane.handoff,
            CLAIM: plane.claim,
            ACCEPT: plane.accept,
            HEARTBEAT: lambda req, peer: plane.heartbeat(req.session_id, peer),
        }
        #: op -> (request model, handler), as the route table names them
        self.ops: dict[bytes, tuple[type[BaseModel], Handler]] = {
            r.fast: (r.request, handler) for r, handler in handlers.items() if r.fast and r.request
        }

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, self.mode)
        self._sweeper = asyncio.create_task(self._sweep())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        # Each open connection ends here, as if its client had gone: left to the loop's own shutdown, its task is
        # cancelled, and asyncio's stream callback logs that as an error with a traceback, every stop.
        for writer in self._serving.values():
            writer.close()
        if self._serving:
            await asyncio.wait(list(self._serving), timeout=1.0)
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.connections >= self.max_connections:
            limit = LimitExceeded(
                f"the fast channel has {self.connections} connections open: the limit is {self.max_connections} "
                "(--max-fast-connections, KVPOOL_MAX_FAST_CONNECTIONS); close idle clients, or raise it"
            )
            self.refusals.note(
                "max_fast_connections", f"fast-channel connections past --max-fast-connections {self.max_connections}"
            )
            writer.write(_error(limit))
            writer.close()
            return
        self.connections += 1
        loop = asyncio.get_running_loop()
        hello_by = loop.time() + self.hello_timeout_s
        reading = _Reading(writer)
        self._open.add(reading)
        task = asyncio.current_task()
        if task is not None:
            self._serving[task] = writer
        authorized = False
        peer = peer_of(writer.get_extra_info("socket"), writer.get_extra_info("peername"))
        head: asyncio.Future[bytes] | None = None  # the next frame's header, when a waiting claim started its read

        def watch() -> asyncio.Future[bytes]:
            """Read the start of the next frame's header while a claim waits: it raises at end of file, when the
            claimer has gone."""
            nonlocal head
            head = asyncio.ensure_future(_some(reader, HEADER.size))
            return head

        try:
            while True:
                held = 0
                if not authorized:
                    frame = await self._hello_frame(reader, hello_by)
                else:
                    # as much of the header as has come (all of it, but for a client that sends it piecemeal): its
                    # first byte starts the clock, and an idle connection between frames waits for ever
                    raw = await (head if head is not None else reader.read(HEADER.size))
                    head = None
                    if not raw:
                        return
                    reading.since = loop.time()
                    frame = await self._frame(raw, reader)
                    reading.since = None
                    held = len(frame) if isinstance(frame, bytes) else 0
                if isinstance(frame, KvpoolError):
                    writer.write(_error(frame))
                    await writer.drain()
                    return
                try:
                    op, _, body = frame.partition(b"\n")
                    del frame
                    if op == HELLO.fast:
                        reply = self._hello(body)
                        authorized = reply[HEADER.size : HEADER.size + 3] == b"200"
                    elif not authorized:
                        reply = _error(Unauthorized("say hello first (with the pool's token, if it has one)"))
                    elif op == ARENA_FD.fast:
                        await self._arena_fd(body, writer)
                        continue
                    else:
                        reply = await self._call(op, body, watch if op in WAITS else None, peer)
                    del body
                finally:  # before the reply waits for its reader: a client that does not read holds no budget
                    self.buffered -= held
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            self.connections -= 1
            self._open.discard(reading)
            self._serving.pop(task, None)  # type: ignore[arg-type]
            if head is not None and not head.done():
                head.cancel()
            writer.close()

    async def _hello_frame(self, reader: asyncio.StreamReader, by: float) -> bytes | KvpoolError:
        """A frame of a connection that has not said hello: small, and in time for the hello's deadline (from the
        connection's start, so that wrong hellos one after the other do not hold it open either)."""
        try:
            return await asyncio.wait_for(self._small_frame(reader), by - asyncio.get_running_loop().time())
        except TimeoutError:
            self.refusals.note(
                "hello_timeout_s",
                f"fast-channel connections that said no hello within --hello-timeout-s {self.hello_timeout_s:g}",
            )
            raise

    async def _small_frame(self, reader: asyncio.StreamReader) -> bytes | KvpoolError:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if size > HELLO_MAX:
            return PayloadTooLarge(f"frame of {size} bytes before hello, over {HELLO_MAX}: say hello first")
        return await reader.readexactly(size)

    async def _frame(self, start: bytes, reader: asyncio.StreamReader) -> bytes | KvpoolError:
        """The rest of a frame whose first bytes came (the sweep cuts the connection if it takes too long). Its bytes
        are taken from ``max_buffered`` as they come, not when its length does: a frame that stalls holds what it
        sent (at most the largest frame), and only until the read deadline. The caller gives them back once the
        frame is answered."""
        if len(start) < HEADER.size:
            start += await reader.readexactly(HEADER.size - len(start))
        (size,) = HEADER.unpack(start)
        if size > self.max_frame:
            return PayloadTooLarge(
                f"frame of {size} bytes over {self.max_frame} (--max-body-bytes, KVPOOL_MAX_BODY_BYTES)"
            )
        parts: list[bytes] = []
        got = 0
        try:
            while got < size:
                chunk = await reader.read(size - got)
                if not chunk:
                    raise asyncio.IncompleteReadError(b"".join(parts), size)
                if self.buffered + len(chunk) > self.max_buffered:
                    self.buffered -= got
                    got = 0
                    return self._over_budget(size)
                self.buffered += len(chunk)
                got += len(chunk)
                parts.append(chunk)
        except BaseException:
            self.buffered -= got
            raise
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _over_budget(self, size: int) -> KvpoolError:
        self.refusals.note(
            "max_fast_buffer_bytes", f"fast-channel frames past --max-fast-buffer-bytes {self.max_buffered}"
        )
        return LimitExceeded(
            f"the fast channel holds {self.buffered} bytes of frames being read or answered, and the rest of this "
            f"one of {size} would pass {self.max_buffered} (--max-fast-buffer-bytes, KVPOOL_MAX_FAST_BUFFER_BYTES): "
            "send it again, or raise the limit"
        )

    async def _sweep(self) -> None:
        """Cut the connections that sent part of a frame and not the rest within ``read_timeout_s``: their read
        then ends."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.read_timeout_s / 4)
            late = loop.time() - self.read_timeout_s
            for reading in [r for r in self._open if r.since is not None and r.since < late]:
                reading.since = None
                self.refusals.note(
                    "read_timeout_s",
                    f"fast-channel connections that sent part of a frame and not the rest within --read-timeout-s "
                    f"{self.read_timeout_s:g}",
                )
                reading.writer.transport.abort()

    async def _arena_fd(self, body: bytes, writer: asyncio.StreamWriter) -> None:
        """Answer with the arena's fd attached (SCM_RIGHTS): only here, after hello, and for a live session."""
        try:
            req = ArenaFdRequest.model_validate_json(body)
            result, fd = self.plane.arena_fd(req)
        except ValidationError as exc:
            writer.write(_encode(422, _validation(exc)))
        except KvpoolError as exc:
            writer.write(_error(exc))
        else:
            await send_with_fd(writer, _encode(200, result.model_dump_json().encode()), fd)
        await writer.drain()

    def _hello(self, body: bytes) -> bytes:
        try:
            hello = Hello.model_validate_json(body or b"{}")
        except ValidationError as exc:
            return _encode(422, _validation(exc))
        if self.token is not None and not hmac.compare_digest((hello.token or "").encode(), self.token):
            return _error(Unauthorized("missing or wrong token in hello"))
        return _encode(200, b'{"epoch": "%s"}' % self.plane.epoch.encode())

    async def _call(
        self,
        op: bytes,
        body: bytes,
        watch: Callable[[], asyncio.Future[bytes]] | None = None,
        peer: Peer | None = None,
    ) -> bytes:
        entry = self.ops.get(op)
        if entry is None:
            return _error(KvpoolError(f"unknown op {op[:32]!r}; ops: {sorted(o.decode() for o in self.ops)}"))
        model, handler = entry
        try:
            req, ids = decode(model, body, op in PACKED)
            if watch is not None:
                result = handler(req, watch)
            elif op == HANDOFF.fast:
                result = handler(req, ids)  # the ids as they came, for the delivery to an inbox
            elif op in PEERED:
                result = handler(req, peer)
            else:
                result = handler(req)
            if isinstance(result, Awaitable):
                result = await result
            return _encode(200, _reply(result))
        except ValidationError as exc:
            if op == HANDOFF.fast:
                self._refused(body, exc)
            return _encode(422, _validation(exc))
        except KvpoolError as exc:
            return _error(exc)
        except Exception as exc:
            log.exception("fast channel op %s failed", op)
            return _encode(500, json.dumps(error_body(f"internal error: {exc!r}", "KvpoolError")).encode())

    def _refused(self, body: bytes, exc: ValidationError) -> None:
        """An addressed handoff refused before it reached the books: its ids may already be with the addressee
        (the producer sends them once the pool has the frame), so the refusal is kept for its claim, as the
        books keep their own."""
        try:
            head = json.loads(body.partition(b"\0")[0])
        except (ValueError, RecursionError):  # nested too deep for the parser: no request id to speak of
            return
        if not isinstance(head, dict):
            return
        request_id, to, by = head.get("request_id"), head.get("to"), head.get("session_id")
        if (
            isinstance(request_id, str)
            and 0 < len(request_id) <= 256
            and isinstance(to, str)
            and isinstance(by, str)
            and self.plane.ready
        ):
            fields = ", ".join(".".join(map(str, e["loc"])) for e in exc.errors(include_url=False))
            self.plane.refuse(request_id, f"ValidationError: invalid {fields}", by)


async def _some(reader: asyncio.StreamReader, n: int) -> bytes:
    """Up to ``n`` bytes, at least one: IncompleteReadError at end of file."""
    data = await reader.read(n)
    if not data:
        raise asyncio.IncompleteReadError(b"", n)
    return data


class _Reading:
    """A connection, and since when (the loop's clock) it has been reading a frame: None between frames."""

    __slots__ = ("since", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.since: float | None = None


def _reply(result: BaseModel) -> bytes:
    """The reply's body, with its block ids attached packed when it has any."""
    ids = getattr(result, "block_ids", None)
    packed = pack_ids(ids) if ids else None
    if packed is None:
        return result.model_dump_json().encode()
    return encode(result.model_copy(update={"block_ids": []}), packed)


def _validation(exc: ValidationError) -> bytes:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    return json.dumps(error_body(errors, "ValidationError")).encode()
