"""The fast channel: the control plane's hot calls over a Unix socket, without HTTP.

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
from kvpool.fdpass import send_with_fd
from kvpool.ids import pack_ids
from kvpool.protocol import (
    AllocRequest,
    ArenaFdRequest,
    ClaimRequest,
    CommitRequest,
    FreeRequest,
    HandoffRequest,
    Hello,
    LookupManyRequest,
    LookupRequest,
    SessionRef,
)
from kvpool.server.plane import ControlPlane

log = logging.getLogger(__name__)

Handler = Callable[[Any], Any]
#: the largest frame taken before a connection's hello (a hello is a token, at most 4096 characters, in JSON):
#: a stranger holds no more memory than this, and no longer than the hello time-out
HELLO_MAX = 16 << 10
#: ops that may wait: they stop waiting when their connection closes
WAITS = frozenset({b"claim", b"accept"})
#: ops whose handler takes attached ids as they came (an ``array('q')``): the books unfence them without a list
PACKED = frozenset({b"free"})


def _encode(status: int, body: bytes) -> bytes:
    return frame(b"%d" % status, body)


def _error(exc: KvpoolError) -> bytes:
    return _encode(exc.status, json.dumps(body_for(exc)).encode())


class FastChannel:
    def __init__(
        self,
        plane: ControlPlane,
        path: Path,
        mode: int,
        max_frame: int,
        max_connections: int = 4096,
        hello_timeout_s: float = 10.0,
    ) -> None:
        self.plane = plane
        self.path = path
        self.mode = mode
        self.max_frame = max_frame
        self.max_connections = max_connections
        self.hello_timeout_s = hello_timeout_s
        self.connections = 0
        token = plane.settings.token
        self.token = token.get_secret_value().encode() if token else None
        self._server: asyncio.AbstractServer | None = None
        self._serving: dict[asyncio.Task[None], asyncio.StreamWriter] = {}  # connections being served, closed at stop
        self.ops: dict[bytes, tuple[type[BaseModel], Handler]] = {
            b"alloc": (AllocRequest, plane.alloc),
            b"free": (FreeRequest, plane.free),
            b"commit": (CommitRequest, plane.commit),
            b"lookup": (LookupRequest, plane.lookup),
            b"lookups": (LookupManyRequest, plane.lookup_many),
            b"handoff": (HandoffRequest, plane.handoff),
            b"claim": (ClaimRequest, plane.claim),
            b"accept": (ClaimRequest, plane.accept),
            b"heartbeat": (SessionRef, lambda req: plane.heartbeat(req.session_id)),
        }

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        os.chmod(self.path, self.mode)

    async def stop(self) -> None:
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
            self.plane.count_exceeded("max_fast_connections")
            writer.write(_error(limit))
            writer.close()
            return
        self.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._serving[task] = writer
        authorized = False
        head: asyncio.Future[bytes] | None = None  # the next frame's header, when a waiting claim started its read

        def watch() -> asyncio.Future[bytes]:
            """Read the next header while a claim waits: it raises at end of file, when the claimer has gone."""
            nonlocal head
            head = asyncio.ensure_future(reader.readexactly(HEADER.size))
            return head

        try:
            while True:
                if not authorized:
                    # A stranger gets a small frame and a few seconds to say hello, no more of the pool's memory.
                    raw = await asyncio.wait_for(reader.readexactly(HEADER.size), self.hello_timeout_s)
                    frame = await asyncio.wait_for(self._frame(raw, HELLO_MAX, reader), self.hello_timeout_s)
                else:
                    raw = await (head if head is not None else reader.readexactly(HEADER.size))
                    head = None
                    frame = await self._frame(raw, self.max_frame, reader)
                if frame is None:
                    writer.write(_error(PayloadTooLarge(self._too_large(raw, authorized))))
                    await writer.drain()
                    return
                op, _, body = frame.partition(b"\n")
                if op == b"hello":
                    reply = self._hello(body)
                    authorized = reply[HEADER.size : HEADER.size + 3] == b"200"
                elif not authorized:
                    reply = _error(Unauthorized("say hello first (with the pool's token, if it has one)"))
                elif op == b"arena_fd":
                    await self._arena_fd(body, writer)
                    continue
                else:
                    reply = await self._call(op, body, watch if op in WAITS else None)
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass
        finally:
            self.connections -= 1
            self._serving.pop(task, None)  # type: ignore[arg-type]
            if head is not None and not head.done():
                head.cancel()
            writer.close()

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

    async def _frame(self, raw: bytes, limit: int, reader: asyncio.StreamReader) -> bytes | None:
        (size,) = HEADER.unpack(raw)
        return None if size > limit else await reader.readexactly(size)

    def _too_large(self, raw: bytes, authorized: bool) -> str:
        (size,) = HEADER.unpack(raw)
        if authorized:
            return f"frame of {size} bytes over {self.max_frame} (--max-body-bytes, KVPOOL_MAX_BODY_BYTES)"
        return f"frame of {size} bytes before hello, over {HELLO_MAX}: say hello first"

    def _hello(self, body: bytes) -> bytes:
        try:
            hello = Hello.model_validate_json(body or b"{}")
        except ValidationError as exc:
            return _encode(422, _validation(exc))
        if self.token is not None and not hmac.compare_digest((hello.token or "").encode(), self.token):
            return _error(Unauthorized("missing or wrong token in hello"))
        return _encode(200, b'{"epoch": "%s"}' % self.plane.epoch.encode())

    async def _call(self, op: bytes, body: bytes, watch: Callable[[], asyncio.Future[bytes]] | None = None) -> bytes:
        entry = self.ops.get(op)
        if entry is None:
            return _error(KvpoolError(f"unknown op {op[:32]!r}; ops: {sorted(o.decode() for o in self.ops)}"))
        model, handler = entry
        try:
            req, ids = decode(model, body, op in PACKED)
            if watch is not None:
                result = handler(req, watch)
            elif op == b"handoff":
                result = handler(req, ids)  # the ids as they came, for the delivery to an inbox
            else:
                result = handler(req)
            if isinstance(result, Awaitable):
                result = await result
            return _encode(200, _reply(result))
        except ValidationError as exc:
            if op == b"handoff":
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
        except ValueError:
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
