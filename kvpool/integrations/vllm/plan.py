"""What the worker side does in one engine step, as plain data the scheduler side builds and vLLM carries over.

The scheduler decides; the worker copies and talks to the pool about the blocks it wrote. Nothing here imports
vLLM or torch, so the plans are tested on their own.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import xxhash


@dataclass
class Load:
    """Copy arena blocks into the vLLM blocks given to them (the scheduler holds the pool's refs meanwhile)."""

    req_id: str
    arena_ids: list[int]
    engine_ids: list[int]


@dataclass
class Save:
    """After this step's forward, copy a prompt's full blocks into the pool and commit them; a prefill for a
    decode engine (``park`` set) also parks them under ``park``."""

    req_id: str
    token_ids: list[int]
    engine_ids: list[int]
    park: str | None = None
    digest: str = ""
    skip: int = 0  # leading blocks the pool held when the request was matched: not copied again
    salt: str | None = None  # the chain's salt: the KV's identity (kvpool.integrations.vllm.identity)


@dataclass
class StepPlan:
    epoch: str = ""
    loads: list[Load] = field(default_factory=list)
    saves: list[Save] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


def prompt_digest(token_ids: list[int], salt: str | None = None) -> str:
    """Names a prompt's KV (its tokens, and its identity where given), so that a decode engine loads a handoff only
    for the very prompt, of the very identity, that was prefilled."""
    digest = xxhash.xxh3_128_hexdigest(array("I", token_ids).tobytes())
    return digest if salt is None else f"{digest}:{salt}"


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class Tracked:
    """The scheduler side's view of one request."""

    prompt: list[int]
    held: list[int] = field(default_factory=list)  # arena blocks the scheduler's session holds refs on
    first_block: int = 0  # the first of ``held`` that vLLM did not have locally
    external: int = 0  # tokens vLLM will take from the pool
    blocks: list[int] = field(default_factory=list)  # vLLM's blocks of the request
    park: str | None = None  # handoff key, for a prefill whose decode runs elsewhere
    saved: bool = False
    pool_blocks: int = 0  # leading blocks the pool held at the match
    lane: int = 0  # the scheduler's session whose refs ``held`` are
    salt: str | None = None  # the request's KV identity: its chains' salt
