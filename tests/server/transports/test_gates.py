"""The gates in front of the app: what anyone may send without the token is answered at the door."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvpool.server.transports.gates import RequireToken

TOKEN = b"secret"


def call(gate: RequireToken, method: str, path: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> list[Any]:
    sent: list[dict[str, Any]] = []
    scope = {"type": "http", "method": method, "path": path, "headers": list(headers)}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(gate(scope, receive, send))
    return sent


def test_health_is_answered_at_the_door_without_the_app() -> None:
    """A flood of token-less ``GET /health`` once cost the pool's loop a whole answer through the app each
    (issue 46, finding 4's token holders' p99): none of them may reach it."""
    reached: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    answers = iter([(503, b'{"status":"starting","epoch":"e"}'), (200, b'{"status":"ok","epoch":"e"}')])
    gate = RequireToken(app, TOKEN, health=lambda: next(answers))
    for status, state in ((503, "starting"), (200, "ok")):
        start, body = call(gate, "GET", "/health")
        assert start["status"] == status and json.loads(body["body"]) == {"status": state, "epoch": "e"}
        assert (b"content-length", str(len(body["body"])).encode()) in start["headers"]
    assert call(gate, "POST", "/alloc")[0]["status"] == 401
    call(gate, "POST", "/alloc", ((b"authorization", b"Bearer " + TOKEN),))
    assert reached == ["/alloc"]  # only the token holder's call
