"""The lease endpoints: a session's region of the lease table, its slab's refills and drains, pair keys, and the
settling of handoffs between slabs. Control calls only; see :mod:`kvpool.server.leases` for what they do."""

from __future__ import annotations

from fastapi import APIRouter

from kvpool.errors import InvalidRequest
from kvpool.lease_protocol import (
    LeaseInfo,
    LeaseOpen,
    PairRequest,
    PairResponse,
    SettleRequest,
    SettleResponse,
    SlabRequest,
    SlabResponse,
)
from kvpool.server.leases import LeaseBooks
from kvpool.server.plane import ControlPlane


def _books(plane: ControlPlane) -> LeaseBooks:
    plane.pool  # noqa: B018 - raises while starting
    if plane.leases is None:
        raise InvalidRequest("this pool serves no slabs: start it with --leases (KVPOOL_LEASES=1)")
    return plane.leases


def lease_router(plane: ControlPlane) -> APIRouter:
    api = APIRouter(prefix="/leases")

    @api.post("")
    async def open_lease(req: LeaseOpen) -> LeaseInfo:
        """This session's region of the lease table (one per session; asking again answers the same)."""
        books = _books(plane)
        lease = books.open(req.session_id)
        return LeaseInfo(
            table=str(books.path), region=lease.region, nonce=lease.nonce, slots=books.slots,
            num_blocks=plane.pool.total_blocks, box=lease.box,
        )  # fmt: skip

    @api.post("/slab")
    async def slab(req: SlabRequest) -> SlabResponse:
        """Add ``take`` blocks to the session's slab and return the idle ``give`` ones, in one call; 507 when
        there is no room (the pool then asks other slabs for their idle blocks)."""
        books = _books(plane)
        ids = books.grant(req.session_id, req.take, req.give, plane.arena_index(req.device))
        return SlabResponse.model_construct(block_ids=ids)

    @api.post("/pair")
    async def pair(req: PairRequest) -> PairResponse:
        """The key of a producer-consumer pair: a producer names the consumer (``to``), a consumer the producer's
        region and nonce, as its first handoff's datagram carried them."""
        books = _books(plane)
        if req.to is not None:
            lease, key = books.pair_to(req.session_id, req.to)
            return PairResponse(key=key.hex(), region=lease.region, nonce=lease.nonce, box=lease.box)
        if req.from_region is None or req.from_nonce is None:
            raise InvalidRequest("give either to (a producer) or from_region and from_nonce (a consumer)")
        return PairResponse(key=books.pair_from(req.session_id, req.from_region, req.from_nonce).hex())

    @api.post("/settle")
    async def settle(req: SettleRequest) -> SettleResponse:
        """Move the refs of blocks handed from these regions now, and say whether the session holds ``holds`` (taking
        the handoff ``took`` names first, if it is in flight to it)."""
        books = _books(plane)
        plane.pool.session(req.session_id)
        settled = sum(books.settle(r) for r in set(req.regions))
        holds = books.holds(req.session_id, req.holds, req.took) if req.holds else True
        return SettleResponse(settled=settled, holds=holds)

    return api
