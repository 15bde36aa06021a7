"""The fast channel: the control plane's hot calls over a Unix socket, without HTTP.

An HTTP round trip through an ASGI framework costs about a millisecond, more than moving a gigabyte of KV on
the GPU; a length-prefixed frame on a kept-open Unix socket costs tens of microseconds. The channel carries
the same calls with the same pydantic models and the same errors as the HTTP API, and ownership still moves
in the same books, so a crash loses nothing. ``/claim`` waits are pushed: the claimer's reply goes out as
soon as the handoff is parked.

Frame: a 4-byte little-endian length, then ``op\\n`` and a JSON body, with block ids attached packed (see
:mod:`kvpool.channel`). Reply: the same framing, with ``status\\n``. The first frame of a connection is ``hello``
(with the token, if the pool has one). ``accept`` is ``claim`` for a claimer that already holds the ids (its
producer delivered them to its inbox): the answer leaves them out.
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

from kvpool.server.plane import ControlPlane
from pydantic import BaseModel, ValidationError

from kvpool.channel import HEADER, decode, encode, frame
from kvpool.errors import KvpoolError, PayloadTooLarge, Unauthorized, body_for, error_body
from kvpool.ids import pack_ids
from kvpool.protocol import (
    AllocRequest,
    ClaimRequest,
    CommitRequest,
    FreeRequest,
    HandoffRequest,
    Hello,
    LookupRequest,
    SessionRef,
)

log = logging.getLogger(__name__)

Handler = Callable[[Any], Any]


def _encode(status: int, body: bytes) -> bytes:
    return frame(b"%d" % status, body)


def _error(exc: KvpoolError) -> bytes:
    return _encode(exc.status, json.dumps(body_for(exc)).encode())


class FastChannel:
    def __init__(self, plane: ControlPlane, path: Path, mode: int, max_frame: int) -> None:
        self.plane = plane
        self.path = path
        self.mode = mode
        self.max_frame = max_frame
        token = plane.settings.token
        self.token = token.get_secret_value().encode() if token else None
        self._server: asyncio.AbstractServer | None = None
        self.ops: dict[bytes, tuple[type[BaseModel], Handler]] = {
            b"alloc": (AllocRequest, plane.alloc),
            b"free": (FreeRequest, plane.free),
            b"commit": (CommitRequest, plane.commit),
            b"lookup": (LookupRequest, plane.lookup),
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
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        authorized = False
        try:
            while True:
                (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                if size > self.max_frame:
                    writer.write(_error(PayloadTooLarge(f"frame of {size} bytes over {self.max_frame}")))
                    await writer.drain()
                    return
                frame = await reader.readexactly(size)
                op, _, body = frame.partition(b"\n")
                if op == b"hello":
                    reply = self._hello(body)
                    authorized = reply[HEADER.size : HEADER.size + 3] == b"200"
                elif not authorized:
                    reply = _error(Unauthorized("say hello first (with the pool's token, if it has one)"))
                else:
                    reply = await self._call(op, body)
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _hello(self, body: bytes) -> bytes:
        try:
            hello = Hello.model_validate_json(body or b"{}")
        except ValidationError as exc:
            return _encode(422, _validation(exc))
        if self.token is not None and not hmac.compare_digest((hello.token or "").encode(), self.token):
            return _error(Unauthorized("missing or wrong token in hello"))
        return _encode(200, b'{"epoch": "%s"}' % self.plane.epoch.encode())

    async def _call(self, op: bytes, body: bytes) -> bytes:
        entry = self.ops.get(op)
        if entry is None:
            return _error(KvpoolError(f"unknown op {op[:32]!r}; ops: {sorted(o.decode() for o in self.ops)}"))
        model, handler = entry
        try:
            result = handler(decode(model, body)[0])
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
        request_id, to = head.get("request_id"), head.get("to")
        if isinstance(request_id, str) and 0 < len(request_id) <= 256 and isinstance(to, str) and self.plane.ready:
            fields = ", ".join(".".join(map(str, e["loc"])) for e in exc.errors(include_url=False))
            self.plane.refuse(request_id, f"ValidationError: invalid {fields}")


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
