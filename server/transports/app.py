"""The HTTP control API: pydantic validation in, the control plane's handlers, domain errors out as 4xx."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi_offline import FastAPIOffline
from prometheus_client.exposition import choose_encoder
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvpool.errors import KvpoolError
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
    HeldBlocks,
    LookupManyRequest,
    LookupManyResponse,
    LookupRequest,
    LookupResponse,
    SessionCreate,
    SessionInfo,
    SessionList,
)
from kvpool.server.books.records import sweep_period_s
from kvpool.server.events.metrics import registry_for, time_operations
from kvpool.server.plane import ControlPlane
from kvpool.server.remote.api import remote_router
from kvpool.server.transports.connections import request_peer
from kvpool.server.transports.gates import BodyLimit, Receive, RequireToken
from kvpool.server.transports.http_errors import ERRORS, error_response, http_error_response, validation_response
from kvpool.server.transports.slab_api import slab_router

log = logging.getLogger(__name__)


def create_app(plane: ControlPlane) -> FastAPI:
    settings = plane.settings
    token = settings.token.get_secret_value().encode() if settings.token else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = []
        if not plane.ready:
            start = asyncio.create_task(asyncio.to_thread(plane.start))
            start.add_done_callback(lambda task: _stop_on_failure(app, task))
            tasks.append(start)
        tasks.append(asyncio.create_task(_sweep(plane)))
        for hook in app.state.on_start:
            await hook()
        try:
            yield
        finally:
            for hook in app.state.on_stop:
                await hook()
            if plane.remote is not None:
                await plane.remote.aclose()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            plane.close()

    # the docs pages' scripts and styles are served by the pool itself: a serving node often has no way out
    app = FastAPIOffline(
        static_url="/docs-assets",
        title="kvpool",
        summary="Node-local KV-cache pool: block ids over a local control API.",
        version="0.1.0",
        lifespan=lifespan,
        responses=ERRORS,
    )
    app.state.plane = plane
    app.state.on_start = []
    app.state.on_stop = []
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequireToken, token=token, health=plane.health)  # added last, so it runs first

    @app.exception_handler(KvpoolError)
    async def _domain_error(request: Request, exc: KvpoolError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error_response(exc)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health() -> Any:
        """Ready (200) once the arena is allocated, 503 before: what readiness probes ask. Needs no token."""
        if plane.ready:
            return Health(status="ok", epoch=plane.epoch)
        return JSONResponse(Health(status="starting", epoch=plane.epoch).model_dump(), status_code=503)

    api = APIRouter()  # the token is checked for every path but /health by RequireToken, before any body is read
    registry = registry_for(plane.stats)
    time_operations(plane, registry)

    @api.get("/arena")
    async def arena() -> ArenaDescriptor:
        """The arena descriptor a client maps the arena from: epoch, backend, device, handle, sizes, layout."""
        return plane.descriptor

    @api.post("/sessions")
    async def open_session(req: SessionCreate, request: Request) -> SessionInfo:
        """Open a session: the owner of the blocks it allocates, kept alive by heartbeats; a layout that
        differs from the arena's is refused (409), and so is a name held under another name key (or under one,
        when none is given). Over the Unix socket, the pool notes the calling process: if the lease runs out, the
        blocks it could still write stay quarantined until it exits."""
        return plane.open_session(req, request_peer(request.scope))

    @api.get("/sessions")
    async def list_sessions(name: str | None = Query(None, max_length=128)) -> SessionList:
        """Live sessions by name, role and inbox (never their ids): how a producer finds its consumer's inbox."""
        return plane.sessions(name)

    @api.post("/sessions/{session_id}/heartbeat")
    async def heartbeat(session_id: str, request: Request) -> SessionInfo:
        """Extend the session's lease; an unknown or expired session is 404."""
        return plane.heartbeat(session_id, request_peer(request.scope))

    @api.get("/sessions/{session_id}/blocks")
    async def held_blocks(session_id: str) -> HeldBlocks:
        """The blocks the session holds refs on (fenced ids, one per ref), slab blocks included; unknown or expired:
        404. What a client can check its own books against."""
        return plane.held(session_id)

    @api.delete("/sessions/{session_id}")
    async def close_session(session_id: str) -> dict[str, int]:
        """End the session and release every ref it holds, as its expiry would."""
        return plane.close_session(session_id)

    @api.post("/alloc")
    async def alloc(req: AllocRequest) -> AllocResponse:
        """Take blocks for the session (free ones first, then the least recently used cached ones); 507 when
        there is not enough room."""
        return plane.alloc(req)

    @api.post("/free")
    async def free(req: FreeRequest) -> FreeResponse:
        """Drop the session's refs on blocks; a block it holds no ref on is 409 and nothing is freed."""
        return plane.free(req)

    @api.post("/commit")
    async def commit(req: CommitRequest) -> CommitResponse:
        """Index the session's full blocks under the hash chain of their tokens, so any worker can reuse them."""
        return plane.commit(req)

    @api.post("/lookup")
    async def lookup(req: LookupRequest) -> LookupResponse:
        """The longest cached prefix of the tokens, with a ref taken on each block for the session."""
        return plane.lookup(req)

    @api.post("/lookups")
    async def lookup_many(req: LookupManyRequest) -> LookupManyResponse:
        """Several lookups in one call, answered in order, each as /lookup answers it."""
        return plane.lookup_many(req)

    @api.post("/handoff")
    async def handoff(req: HandoffRequest) -> HandoffResponse:
        """Park blocks under a request id, moving the session's refs to the handoff, for one claim."""
        return plane.handoff(req)

    @api.post("/claim")
    async def claim(req: ClaimRequest, request: Request) -> ClaimResponse:
        """Take a parked handoff (waiting up to timeout_s), its refs moved to the session; 404 on time-out."""
        watching: list[asyncio.Future[object]] = []

        def watch() -> asyncio.Future[object]:
            watching.append(asyncio.ensure_future(_disconnected(request.receive)))
            return watching[-1]

        try:
            return await plane.claim(req, watch)
        finally:
            for task in watching:
                task.cancel()

    @api.get("/stats")
    async def stats() -> dict[str, Any]:
        """The books (free, in use, cached), sessions, handoffs, hit rate and counters, per arena too."""
        return plane.stats()

    @api.get("/prefix/blocks")
    async def prefix_blocks(limit: int = Query(10_000, ge=1, le=100_000)) -> dict[str, Any]:
        """The findable prefix blocks as KV events name them: what a router that missed no event holds."""
        return plane.prefix_blocks(limit)

    @api.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        """Prometheus metrics, names ``kvpool_*``: the books, counters and per-operation latency histograms.

        Prometheus text by default, OpenMetrics when the scraper's Accept header asks for it.
        """
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(registry), media_type=content_type)

    app.include_router(api)
    app.include_router(slab_router(plane))
    app.include_router(remote_router(plane))
    return app


async def _disconnected(receive: Receive) -> None:
    """Raise once the HTTP client has gone away (the body is read already: the next message says so)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionResetError("the client went away")


def _stop_on_failure(app: FastAPI, task: asyncio.Task[None]) -> None:
    """A pool whose arena could not be allocated exits loudly instead of answering 503 forever."""
    if not task.cancelled() and task.exception() is not None:
        on_fatal = getattr(app.state, "on_fatal", None)
        if on_fatal is not None:
            on_fatal()


async def _sweep(plane: ControlPlane) -> None:
    """Release expired sessions and handoffs often enough to keep reclaim within a second of the lease."""
    period = sweep_period_s(plane.settings.lease_ttl_s, plane.settings.handoff_ttl_s)
    while True:
        await asyncio.sleep(period)
        try:
            plane.expire()
        except Exception:
            log.exception("expiry sweep failed")
