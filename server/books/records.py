"""What the pool's books record: sessions, parked handoffs, refusals, counters, and the per-client limits."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import LimitExceeded
from kvpool.server.books.processes import Peer

Clock = Callable[[], float]
REFUSALS_KEPT = 4096
#: names held under a name key that the pool remembers; past it, the least recently opened of those that no
#: session holds now is forgotten first
NAMES_KEPT = 4096


def sweep_period_s(lease_ttl_s: float, handoff_ttl_s: float) -> float:
    """How often the server sweeps expired sessions and handoffs: often enough to reclaim within a second of a
    lease, and so how long the pool may go without reading its clock while it runs (see ``Pool.pause_slack_s``)."""
    return max(0.02, min(0.5, lease_ttl_s / 4, handoff_ttl_s / 4))


#: the shape of every session id a pool makes: its epoch's first 8 hex digits, a dash, a random part
SESSION_ID = re.compile(r"[0-9a-f]{8}-[0-9A-Za-z_-]+")


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one client can make the pool hold; each is a setting of ``kvpool serve`` (same name)."""

    max_sessions: int = 1024
    max_sessions_per_peer: int = 256
    max_handoffs: int = 65536
    max_handoffs_per_peer: int = 16384
    max_handoffs_per_session: int = 4096
    max_meta_bytes: int = 16 << 10
    max_claims_per_session: int = 64

    def exceeded(self, name: str, what: str) -> LimitExceeded:
        flag, env = "--" + name.replace("_", "-"), "KVPOOL_" + name.upper()
        return LimitExceeded(f"{what}: the limit is {getattr(self, name)} ({flag}, {env}); wait, or raise it")


#: the holder of blocks the pool never hands out (a kv_packed arena's null block): neither a session nor a handoff
RESERVED = "r:reserved"


def holder_of(session_id: str) -> str:
    """The name a session holds its refs under in the allocator's books."""
    return f"s:{session_id}"


@dataclass(slots=True)
class Session:
    session_id: str
    name: str
    role: str
    expires_at: float
    created_at: float
    inbox: str | None = None
    #: the key the pool seals deliveries to this session's inbox with (see kvpool.inbox); given to it alone
    inbox_key: bytes = b""
    #: deliveries sent to its inbox so far: each one's number, which its inbox takes only in increasing order
    deliveries: int = 0
    #: who opened it (:class:`Peer`): the process the fence waits for when it lapses (over a Unix socket), and the
    #: share (a user, a TCP address) whose per-peer bounds it counts against; None: the books called directly
    peer: Peer | None = None

    @property
    def holder(self) -> str:
        return holder_of(self.session_id)


@dataclass(slots=True)
class Handoff:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    meta: dict[str, Any]
    from_session: str
    expires_at: float
    ttl_s: float
    #: the one session that may claim it; None: any. Addressed, it does not expire: it is refused when that session
    #: ends, and its blocks released
    to: str | None = None
    seq: int = 0
    meta_json: bytes = b""  # meta as compact JSON (empty for {}): what its size limit and a delivery's seal cover
    blocks: list[int] = field(default_factory=list)  # the blocks block_ids (fenced) name, as the allocator knows them
    sealed: bool = False  # taken only by a claim that names it
    parked_by: str = ""  # the name of the session that parked it, for the claimer to check
    share: str | None = None  # the share of that session's peer: whose --max-handoffs-per-peer it counts against

    @property
    def holder(self) -> str:
        return f"h:{self.request_id}"

    def claimable_by(self, session_id: str) -> bool:
        return self.to is None or self.to == session_id


@dataclass(slots=True)
class Refusal:
    why: str
    when: str = "when its producer made it"  # or after it was parked: its addressee ended first
    seen: bool = False  # a claim of the request was told: its addressee dropped it


@dataclass(slots=True)
class Counters:
    alloc_requests: int = 0
    alloc_blocks: int = 0
    alloc_exhausted: int = 0
    free_requests: int = 0
    free_blocks: int = 0
    commit_requests: int = 0
    committed_blocks: int = 0
    duplicate_blocks: int = 0
    lookup_requests: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    handoffs: int = 0
    claims: int = 0
    sessions_opened: int = 0
    sessions_expired: int = 0
    handoffs_expired: int = 0
    handoffs_orphaned: int = 0  # addressed handoffs refused because their addressee ended before it claimed them
    blocks_reclaimed: int = 0
    stale_refused: int = 0  # calls refused for naming a stale (fenced) block id
    stale_ids: int = 0
    peer_copies: int = 0  # lookups served in part by copying blocks from another arena (another GPU)
    peer_copied_blocks: int = 0


@dataclass(slots=True)
class LookupResult:
    block_ids: list[int]
    num_tokens: int


@dataclass(slots=True)
class CommitResult:
    committed: int
    duplicates: int
    num_blocks: int
    missing: int = 0
