"""Request and response models of the slab endpoints (``/slabs/...``): slabs and the slab table.

These are control calls, made once per session, per slab refill or drain, per producer-consumer pair, and by a
consumer before it names blocks it was handed; the hot path (alloc, free, a handoff between slabs) makes none.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field

from kvpool.protocol import MAX_IDS, SessionId, _Request
from kvpool.routes import Route

Word = Annotated[int, Field(ge=0, lt=1 << 64)]


class RegionRequest(_Request):
    session_id: SessionId = Field(max_length=64)


class RegionInfo(BaseModel):
    table: str = Field(description="path of the slab table (shared memory, mode 0600)")
    region: int = Field(description="this session's region of the table: it alone writes the region's slots")
    nonce: int = Field(description="identifies this session in its region; peers check it before trusting it")
    slots: int = Field(description="slots per region: the most blocks a slab and its unsettled handoffs hold")
    num_blocks: int
    box: str | None = Field(None, description="where to bind this session's slab box (handoffs from slabs)")


class SlabRequest(_Request):
    session_id: SessionId = Field(max_length=64)
    take: int = Field(0, ge=0, le=1 << 24, description="blocks to add to the slab")
    give: list[int] = Field(default_factory=list, max_length=MAX_IDS, description="idle slab blocks returned")
    device: int | None = Field(None, ge=0, le=1 << 16)


class SlabResponse(BaseModel):
    block_ids: list[int]


class PairRequest(_Request):
    session_id: SessionId = Field(max_length=64)
    to: str | None = Field(None, min_length=1, max_length=128, description="a producer: the consumer's name")
    from_region: int | None = Field(None, ge=0, le=1 << 20, description="a consumer: the producer's region")
    from_nonce: int | None = Field(None, ge=0, lt=1 << 64)


class PairResponse(BaseModel):
    key: str = Field(description="hex key that seals this pair's handoffs; issued to its two sessions alone")
    region: int | None = None
    nonce: int | None = None
    box: str | None = None


class SettleRequest(_Request):
    session_id: SessionId = Field(max_length=64)
    regions: list[int] = Field(default_factory=list, max_length=4096, description="producers' regions to settle")
    holds: list[int] = Field(default_factory=list, max_length=MAX_IDS, description="ids to check this session holds")
    took: list[Word] | None = Field(
        None, min_length=3, max_length=3, description="a consumer: the producer's region and nonce and the sequence "
        "of the handoff that holds lists; the consumer takes it if it is in flight to it with exactly those blocks"
    )  # fmt: skip


class SettleResponse(BaseModel):
    settled: int
    holds: bool


SLAB_REGION = Route("slab_region", "POST", "/slabs", RegionRequest, RegionInfo)
SLAB_BLOCKS = Route("slab_blocks", "POST", "/slabs/blocks", SlabRequest, SlabResponse)
SLAB_PAIR = Route("slab_pair", "POST", "/slabs/pair", PairRequest, PairResponse)
SLAB_SETTLE = Route("slab_settle", "POST", "/slabs/settle", SettleRequest, SettleResponse)
#: the slab's part of the route table (:mod:`kvpool.routes`)
SLAB_ROUTES: tuple[Route, ...] = (SLAB_REGION, SLAB_BLOCKS, SLAB_PAIR, SLAB_SETTLE)
