"""What an engine's residency asks of the pool and tells it: the session it calls, an answer for a request (a
lookup's prefix or a claimed handoff), a claim and what its answer must hold, and a write (release, commit, park)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class ResidentPool(Protocol):
    """What residency needs of a pool session: :class:`kvpool.client.PoolClient` with a slab."""

    def alloc(self, num_blocks: int, device: int | None = None) -> list[int]: ...

    def free(self, block_ids: Sequence[int]) -> int: ...

    def commit(self, block_ids: Sequence[int], token_ids: Sequence[int], start: int = 0) -> Any: ...

    def lookup(self, token_ids: Sequence[int]) -> Any: ...

    def lookup_many(
        self, prompts: Sequence[Sequence[int]], device: int | None = None, *, salts: Sequence[str | None] | None = None
    ) -> list[Any]: ...

    def claim_many(self, request_ids: Sequence[str], timeout_s: float = 0.0) -> list[Any]: ...

    def handoff_many(
        self,
        handoffs: Sequence[tuple[str, Sequence[int], int, dict[str, Any] | None]],
        keep: bool = False,
        sealed: bool = False,
    ) -> list[Any]: ...

    def commit_many(
        self, commits: Sequence[tuple[Sequence[int], Sequence[int], int]], *, salts: Sequence[str | None] | None = None
    ) -> list[Any]: ...


@dataclass
class Hit:
    """What the pool answered for one request: fenced ids this engine's session now holds a ref on, and the tokens
    they hold (a lookup's prefix, or a claimed handoff's full blocks)."""

    ids: list[int]
    num_tokens: int
    meta: dict[str, Any] = field(default_factory=dict)
    #: the engine's block for each id (distinct, inside its arena), worked out on the thread that read the answer
    #: so that a handover does not; None: worked out at install
    blocks: list[int] | None = None
    #: the engine's own object for each of ``blocks`` (vLLM's ``KVCacheBlock``), looked up on that thread too
    found: list[Any] | None = None
    claimed: bool = False  # a parked handoff's blocks (the whole prompt's KV), not a lookup's prefix


NO_HIT = Hit([], 0)


@dataclass
class Claim:
    """A decode engine's claim of the handoff ``key`` for a request, and what its answer must hold."""

    req_id: str
    key: str
    arrived: float  # perf_counter at the request's arrival
    num_tokens: int  # the prompt's
    digest: str | None = None  # what the handoff's meta must say it holds (None: not checked)
    parker: str | None = None  # the name of the session that must have parked it (None: not checked)
    peer: str | None = None  # the peer pool it is parked in (None: this engine's own)
    tokens: list[int] | None = None  # with a peer: the prompt, for the pool to index what it reads under
    salt: str | None = None


@dataclass
class Write:
    """One thing the engine tells the pool (a release, a commit, a park), sent in order with those around it."""

    kind: str
    ids: list[int]
    tokens: list[int] = field(default_factory=list)
    start: int = 0
    key: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    salt: str | None = None
