"""The bodies of the remote endpoints: what a consumer asks its own pool for from a peer pool (another node), and
what pools ask each other. KV bytes never travel in them: a peer names blocks, and NIXL reads them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from kvpool.layout import KVLayout
from kvpool.protocol import MAX_TOKENS, SALT_HELP, ClaimRequest, ClaimResponse, LookupRequest, LookupResponse

PEER_HELP = "a peer pool's URL, exactly as the pool's --peers lists it"


class AgentInfo(BaseModel):
    """A pool's NIXL agent and where its arena's blocks are (``GET /remote/agent``): what a peer reads them with."""

    epoch: str
    agent: str
    metadata: str = Field(description="the NIXL agent's metadata, base64")
    memory: Literal["DRAM", "VRAM"]
    device: int
    base: int
    num_blocks: int
    first_block: int
    block_nbytes: int
    layout: KVLayout
    gpu_direct_rdma: bool | None = Field(
        None, description="the arena is VMM memory allocated GPUDirect RDMA-capable (null: not VMM memory)"
    )


class RemoteClaimRequest(ClaimRequest):
    """Claim a handoff parked at a peer pool: this pool claims it there, reads its blocks into its own arena and
    answers with its own ids; the peer's blocks are released."""

    peer: str = Field(max_length=512, description=PEER_HELP)
    token_ids: list[int] | None = Field(
        None,
        max_length=MAX_TOKENS,
        description="the prompt the handoff holds: with it, the blocks read are indexed here too, as far as the "
        "peer's own index says its claimed blocks hold this prompt's chain (null: not indexed)",
    )
    salt: str | None = Field(None, min_length=1, max_length=256, description=SALT_HELP)


class RemoteClaimResponse(ClaimResponse):
    descriptors: int = Field(description="NIXL descriptors the read posted: one per run of ids and span of a block")
    read_s: float
    indexed: int = Field(0, description="blocks of the answer indexed here under the prompt's chain (token_ids)")


class RemoteLookupRequest(LookupRequest):
    """A lookup that, past what this pool holds, asks its peers for the prompt's chain and reads the longest hit."""

    peers: list[str] | None = Field(None, max_length=64, description="peers to ask, in order; null asks every peer")


class RemoteLookupResponse(LookupResponse):
    read_blocks: int = Field(0, description="blocks of the answer read from a peer (the rest were here)")
    peer: str | None = Field(None, description="the peer they came from")
    peer_errors: dict[str, str] = Field(default_factory=dict, description="peers that could not serve, and why")


class ChainResponse(LookupResponse):
    """A pool's hit for a peer (``POST /remote/chain``), with its chain hashes (hex) for the peer to check against
    its own: blocks of another model, layout or hash are never installed."""

    hashes: list[str]
