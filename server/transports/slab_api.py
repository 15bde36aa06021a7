"""The slab endpoints: a session's region of the slab table, its slab's refills and drains, pair keys, and the
settling of handoffs between slabs. Control calls only; see :mod:`kvpool.server.books.slabs` for what they do.
"""

from __future__ import annotations

from fastapi import APIRouter

from kvpool.errors import InvalidRequest
from kvpool.server.books.slabs import SlabBooks
from kvpool.server.plane import ControlPlane
from kvpool.slab.protocol import (
    PairRequest,
    PairResponse,
    RegionInfo,
    RegionRequest,
    SettleRequest,
    SettleResponse,
    SlabRequest,
    SlabResponse,
)


def _books(plane: ControlPlane) -> SlabBooks:
    plane.pool  # noqa: B018 - raises while starting
    if plane.slabs is None:
        raise InvalidRequest("this pool serves no slabs: start it with --slabs (KVPOOL_SLABS=1)")
    return plane.slabs


def slab_router(plane: ControlPlane) -> APIRouter:
    api = APIRouter()

    async def open_region(req: RegionRequest) -> RegionInfo:
        """This session's region of the slab table (one per session; asking again answers the same)."""
        books = _books(plane)
        occupant = books.open(req.session_id)
        return RegionInfo(
            table=str(books.path), region=occupant.region, nonce=occupant.nonce, slots=books.slots,
            num_blocks=plane.pool.total_blocks, box=occupant.box,
        )  # fmt: skip

    async def blocks(req: SlabRequest) -> SlabResponse:
        """Add ``take`` blocks to the session's slab and return the idle ``give`` ones, in one call; 507 when
        there is no room (the pool then asks other slabs for their idle blocks)."""
        books = _books(plane)
        ids = books.grant(req.session_id, req.take, req.give, plane.arena_index(req.device))
        return SlabResponse.model_construct(block_ids=ids)

    async def pair(req: PairRequest) -> PairResponse:
        """The key of a producer-consumer pair: a producer names the consumer (``to``), a consumer the producer's
        region and nonce, as its first handoff's datagram carried them."""
        books = _books(plane)
        if req.to is not None:
            occupant, key = books.pair_to(req.session_id, req.to)
            return PairResponse(key=key.hex(), region=occupant.region, nonce=occupant.nonce, box=occupant.box)
        if req.from_region is None or req.from_nonce is None:
            raise InvalidRequest("give either to (a producer) or from_region and from_nonce (a consumer)")
        return PairResponse(key=books.pair_from(req.session_id, req.from_region, req.from_nonce).hex())

    async def settle(req: SettleRequest) -> SettleResponse:
        """Move the refs of blocks handed from these regions now, and say whether the session holds ``holds`` (taking
        the handoff ``took`` names first, if it is in flight to it)."""
        books = _books(plane)
        plane.pool.session(req.session_id)
        settled = sum(books.settle(r) for r in set(req.regions))
        holds = books.holds(req.session_id, req.holds, req.took) if req.holds else True
        return SettleResponse(settled=settled, holds=holds)

    for path, handler in (("/slabs", open_region), ("/slabs/blocks", blocks), ("/slabs/pair", pair),
                          ("/slabs/settle", settle)):  # fmt: skip
        api.add_api_route(path, handler, methods=["POST"])
    return api
