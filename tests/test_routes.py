"""The route table is the pool's: every call its HTTP app and fast channel serve is in it, and nothing else."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvpool.routes import ROUTES, Route
from kvpool.server.config import PoolSettings
from kvpool.server.plane import ControlPlane
from kvpool.server.transports.app import create_app
from kvpool.server.transports.fastpath import OWN, FastChannel
from kvpool.slab.protocol import SLAB_ROUTES

TABLE: tuple[Route, ...] = ROUTES + SLAB_ROUTES


@pytest.fixture
def plane(tmp_path: Path) -> ControlPlane:
    """A plane that is never started: the app and the channel are built, not served."""
    return ControlPlane(PoolSettings(backend="cpu", num_blocks=8, socket=tmp_path / "kvpool.sock", port=0))


def _served(plane: ControlPlane) -> dict[tuple[str, str], dict[str, Any]]:
    """The app's calls as its OpenAPI document lists them (the pages of the docs are not in it)."""
    paths = create_app(plane).openapi()["paths"]
    return {(method.upper(), path): call for path, calls in paths.items() for method, call in calls.items()}


def _model(schema: dict[str, Any] | None) -> str | None:
    ref = (schema or {}).get("$ref")
    return ref.rsplit("/", 1)[-1] if ref else None


def test_every_route_of_the_app_is_in_the_table_and_back(plane: ControlPlane) -> None:
    table = {(r.method, r.path): r for r in TABLE if r.path is not None}
    served = _served(plane)
    assert sorted(set(served) - set(table)) == [], "served over HTTP but missing from kvpool.routes"
    assert sorted(set(table) - set(served)) == [], "in kvpool.routes but not served over HTTP"
    for key, route in table.items():
        call = served[key]
        body = _model(call.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema"))
        if body is not None:
            assert route.request is not None and body == route.request.__name__, f"{route.name} takes {body}"
        answer = _model(call["responses"]["200"].get("content", {}).get("application/json", {}).get("schema"))
        if route.response is not None:
            assert answer == route.response.__name__, f"{route.name} answers {answer}"


def test_every_op_of_the_fast_channel_is_in_the_table_and_back(plane: ControlPlane, tmp_path: Path) -> None:
    channel = FastChannel(plane, tmp_path / "kvpool.sock.fast", 0o600, 1 << 20)
    served = set(channel.ops) | {r.fast for r in OWN}
    assert served == {r.fast for r in TABLE if r.fast is not None}
    for route in TABLE:
        if route.fast in channel.ops:
            assert channel.ops[route.fast][0] is route.request, route.name


def test_names_paths_and_ops_are_each_taken_once() -> None:
    for key in ("name", "fast"):
        values = [getattr(r, key) for r in TABLE if getattr(r, key) is not None]
        assert len(values) == len(set(values)), key
    paths = [(r.method, r.path) for r in TABLE if r.path is not None]
    assert len(paths) == len(set(paths))


def test_a_path_takes_its_session_id() -> None:
    (heartbeat,) = [r for r in TABLE if r.name == "heartbeat"]
    assert heartbeat.url("abc") == "/sessions/abc/heartbeat"
    assert heartbeat.url() == "/sessions/{session_id}/heartbeat"
    (alloc,) = [r for r in TABLE if r.name == "alloc"]
    assert alloc.url("abc") == "/alloc"
