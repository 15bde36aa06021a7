"""The framework's floor: the pool's routes and models with nothing behind them, served like the pool.

``python -m kvpool.benchmarks.bare_server --socket S --port P`` serves ``/sessions``, ``/alloc`` and ``/free`` with the
same request and response models as the pool, on a bare FastAPI app (no middleware, no auth dependency), with
the same uvicorn settings as ``kvpool serve`` (access log off, uvloop and httptools when present) on the same kinds
of socket. ``/alloc`` answers a ready-made list of the asked length, ``/free`` the count it was sent: the request is
parsed and the reply built and serialized exactly as the pool does, but no book is touched. The difference between
the pool and this server over the same transport is what kvpool itself costs.

The fast channel's floor is the pool's own :class:`kvpool.server.transports.fastpath.FastChannel` in front of a stub
plane that
answers the same way, at ``<socket>.fast``: its framing and pydantic work without the pool's.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import uvicorn
from fastapi import FastAPI

from kvpool.protocol import (
    AllocRequest,
    AllocResponse,
    FreeRequest,
    FreeResponse,
    Health,
    SessionCreate,
    SessionInfo,
)
from kvpool.server.main import bind_tcp, bind_unix
from kvpool.server.transports.fastpath import FastChannel

EPOCH = "bare"
SESSION = f"{EPOCH}-session"
MAX_IDS = 1 << 16


class StubPlane:
    """What :class:`FastChannel` calls, answering like the pool without any books."""

    def __init__(self) -> None:
        self.settings = SimpleNamespace(token=None)
        self.epoch = EPOCH
        self.ids = list(range(MAX_IDS))

    def alloc(self, req: AllocRequest) -> AllocResponse:
        return AllocResponse.model_construct(block_ids=self.ids[: req.num_blocks])  # as the pool builds it

    def free(self, req: FreeRequest) -> FreeResponse:
        return FreeResponse(freed=len(req.block_ids))

    def info(self, fast_socket: str | None = None) -> SessionInfo:
        return SessionInfo(session_id=SESSION, lease_ttl_s=3600.0, epoch=EPOCH, fast_socket=fast_socket)

    def heartbeat(self, session_id: str) -> SessionInfo:
        return self.info()

    def count_exceeded(self, limit: str) -> None:
        """The pool counts what its limits refused; the floor has no metrics."""

    def _unsupported(self, req: Any) -> Any:
        raise NotImplementedError("the bare floor serves alloc and free only")

    commit = lookup = lookup_many = handoff = claim = accept = _unsupported


def create_bare_app(plane: StubPlane, channel: FastChannel) -> FastAPI:
    """The routes a :class:`kvpool.client.PoolClient` needs for alloc and free, declared as the pool declares them.

    The fast channel starts and stops with the app's lifespan, on the loop uvicorn picked, as in the pool.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await channel.start()
        try:
            yield
        finally:
            await channel.stop()

    app = FastAPI(title="kvpool bare floor", lifespan=lifespan)
    fast_socket = str(channel.path)

    @app.get("/health")
    async def health() -> Health:
        return Health(status="ok", epoch=EPOCH)

    @app.post("/sessions")
    async def open_session(req: SessionCreate) -> SessionInfo:
        return plane.info(fast_socket)

    @app.post("/sessions/{session_id}/heartbeat")
    async def heartbeat(session_id: str) -> SessionInfo:
        return plane.info()

    @app.delete("/sessions/{session_id}")
    async def close_session(session_id: str) -> dict[str, int]:
        return {"released": 0}

    @app.post("/alloc")
    async def alloc(req: AllocRequest) -> AllocResponse:
        return plane.alloc(req)

    @app.post("/free")
    async def free(req: FreeRequest) -> FreeResponse:
        return plane.free(req)

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    plane = StubPlane()
    channel = FastChannel(plane, args.socket.with_name(args.socket.name + ".fast"), 0o600, 16 << 20)  # type: ignore[arg-type]
    app = create_bare_app(plane, channel)
    # The same settings as server/main.py's serve(): only what is served differs.
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=30, lifespan="on")
    uvicorn.Server(config).run(sockets=[bind_tcp("127.0.0.1", args.port), bind_unix(args.socket, 0o600)])


if __name__ == "__main__":
    main()
