"""The remote endpoints (docs/across-nodes.md): what peers ask of this pool, and what consumers ask it to fetch
from peers. Only a pool started with ``--peers`` serves them; the token guards them as every other path."""

from __future__ import annotations

from fastapi import APIRouter

from kvpool.errors import InvalidRequest
from kvpool.protocol import ErrorBody, LookupRequest
from kvpool.remote_protocol import (
    AgentInfo,
    ChainResponse,
    RemoteClaimRequest,
    RemoteClaimResponse,
    RemoteLookupRequest,
    RemoteLookupResponse,
)
from kvpool.server.plane import ControlPlane
from kvpool.server.remote.reads import RemotePeers


def _remote(plane: ControlPlane) -> RemotePeers:
    plane.pool  # noqa: B018 - raises while starting
    if plane.remote is None:
        raise InvalidRequest("this pool has no peers: start it with --peers (and kvpool[nixl] installed)")
    return plane.remote


def remote_router(plane: ControlPlane) -> APIRouter:
    router = APIRouter(prefix="/remote", responses={code: {"model": ErrorBody} for code in (502, 504)})

    @router.get("/agent")
    async def agent() -> AgentInfo:
        """This pool's NIXL agent metadata and its arena's geometry: what a peer reads its blocks with."""
        return _remote(plane).info

    @router.post("/chain")
    async def chain(req: LookupRequest) -> ChainResponse:
        """A lookup for a peer pool, with the chain hashes of the blocks found, for the peer to check."""
        return _remote(plane).chain(req.session_id, req.token_seq(), req.salt)

    @router.post("/claim")
    async def claim(req: RemoteClaimRequest) -> RemoteClaimResponse:
        """Claim a handoff parked at a peer: read here, answered with this pool's block ids; 502 if the peer
        failed, 504 if it stalled past --peer-timeout-s (nothing installed either way)."""
        return await _remote(plane).claim(req)

    @router.post("/lookup")
    async def lookup(req: RemoteLookupRequest) -> RemoteLookupResponse:
        """A lookup that reads the longest further hit its peers hold into this pool and indexes it here."""
        return await _remote(plane).lookup(req, plane.arena_index(req.device))

    return router
