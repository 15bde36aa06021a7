"""What stands in front of the HTTP API, as raw ASGI: the bearer token and the body size limit, checked before the
app (and its body parsing) sees a request."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvpool.errors import PayloadTooLarge, Unauthorized, body_for
from kvpool.server.transports.http_errors import SafeJSONResponse

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

GET_HEALTH = ("GET", "/health")
UNAUTHORIZED = "missing or wrong bearer token: send 'Authorization: Bearer <KVPOOL_TOKEN>'"


class BodyLimit:
    """Refuse bodies over ``limit`` bytes with 413, whether announced by content-length or streamed chunked.

    The body is read here, up to the limit, before the app sees the request: a limit enforced inside the app's
    own body reading would be caught by the framework's parser and answered as a generic 400.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(scope, receive, send)
                return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before sending its whole body
                return
            body += message.get("body", b"")
            if len(body) > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = body_for(PayloadTooLarge(f"request body over {self.limit} bytes"))
        await SafeJSONResponse(body, status_code=413, headers={"connection": "close"})(scope, receive, send)


class RequireToken:
    """With a token set, refuse every request but ``GET /health`` without it, before its body is read; and answer
    ``GET /health`` itself, given ``health``.

    One gate in front of the whole app, rather than a check per route, so "every endpoint but /health" also holds
    for what the framework adds (``/openapi.json``, ``/docs``) and for unknown paths. Whatever anyone may send
    without the token is answered here, at the door, for what it costs to write the answer: through the app a
    ``/health`` took the pool's one loop about 150 us, and a flood of them (at most half the loop's time: see
    :mod:`kvpool.server.transports.turns`) made every token holder's call that came during one wait for it.
    """

    OPEN = frozenset({"/health"})

    def __init__(
        self, app: ASGIApp, token: bytes | None, health: Callable[[], tuple[int, bytes]] | None = None
    ) -> None:
        self.app = app
        self.token = token
        self.health = health

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") in self.OPEN and _announces_body(scope):
            # what needs no token takes no body: else a body up to --max-body-bytes would be read for anyone
            body = body_for(PayloadTooLarge(f"{scope.get('path')} takes no request body"))
            await SafeJSONResponse(body, status_code=413, headers={"connection": "close"})(scope, receive, send)
            return
        if (
            self.health is not None
            and scope["type"] == "http"
            and (scope.get("method"), scope.get("path")) == GET_HEALTH
        ):
            status, answer = self.health()
            headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(answer))]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": answer})
            return
        if self.token is None or scope["type"] != "http" or scope.get("path") in self.OPEN:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
        scheme, _, value = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(value, self.token):
            await self.app(scope, receive, send)
            return
        body = body_for(Unauthorized(UNAUTHORIZED))
        await SafeJSONResponse(body, status_code=401, headers={"www-authenticate": "Bearer"})(scope, receive, send)


def _announces_body(scope: Scope) -> bool:
    for name, value in scope.get("headers", ()):
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() not in (b"", b"0")):
            return True
    return False
