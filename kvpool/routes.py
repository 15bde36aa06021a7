"""The control calls, each named once: its HTTP method and path, its request and response models, and its op on the
fast channel where it has one.

Clients pass a :class:`Route` to their transport, which picks the way (:mod:`kvpool.transport`); the pool's HTTP app
and fast channel serve the same calls, and tests/test_routes.py keeps both equal to this table. The slab's calls are
:data:`kvpool.slab.protocol.SLAB_ROUTES`: a plain client never imports the slab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from kvpool.errors import InvalidRequest
from kvpool.protocol import (
    AcceptResponse,
    AllocRequest,
    AllocResponse,
    ArenaDescriptor,
    ArenaFdRequest,
    ArenaFdResponse,
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
    Hello,
    LookupManyRequest,
    LookupManyResponse,
    LookupRequest,
    LookupResponse,
    SessionCreate,
    SessionInfo,
    SessionList,
    SessionRef,
)
from kvpool.remote_protocol import (
    AgentInfo,
    ChainResponse,
    RemoteClaimRequest,
    RemoteClaimResponse,
    RemoteLookupRequest,
    RemoteLookupResponse,
)


@dataclass(frozen=True, slots=True)
class Route:
    """One control call. ``path`` None: the fast channel alone serves it; ``fast`` None: HTTP alone. A path's
    ``{session_id}`` is the request's own."""

    name: str
    method: str
    path: str | None
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    fast: bytes | None = None

    def build(self, **fields: Any) -> Any:
        """The request from ``fields``; a field the model refuses is InvalidRequest, before anything is sent."""
        assert self.request is not None, f"{self.name} takes no body"
        try:
            return self.request(**fields)
        except ValidationError as exc:
            raise InvalidRequest(str(exc)) from None

    def url(self, session_id: str | None = None) -> str:
        assert self.path is not None, f"{self.name} is served on the fast channel only"
        return self.path if session_id is None or "{" not in self.path else self.path.format(session_id=session_id)


HEALTH = Route("health", "GET", "/health", None, Health)
ARENA = Route("arena", "GET", "/arena", None, ArenaDescriptor)
HELLO = Route("hello", "POST", None, Hello, None, b"hello")
ARENA_FD = Route("arena_fd", "POST", None, ArenaFdRequest, ArenaFdResponse, b"arena_fd")
OPEN_SESSION = Route("open_session", "POST", "/sessions", SessionCreate, SessionInfo)
SESSIONS = Route("sessions", "GET", "/sessions", None, SessionList)
HEARTBEAT = Route("heartbeat", "POST", "/sessions/{session_id}/heartbeat", SessionRef, SessionInfo, b"heartbeat")
HELD = Route("held", "GET", "/sessions/{session_id}/blocks", None, HeldBlocks)
CLOSE_SESSION = Route("close_session", "DELETE", "/sessions/{session_id}")
ALLOC = Route("alloc", "POST", "/alloc", AllocRequest, AllocResponse, b"alloc")
FREE = Route("free", "POST", "/free", FreeRequest, FreeResponse, b"free")
COMMIT = Route("commit", "POST", "/commit", CommitRequest, CommitResponse, b"commit")
LOOKUP = Route("lookup", "POST", "/lookup", LookupRequest, LookupResponse, b"lookup")
LOOKUPS = Route("lookups", "POST", "/lookups", LookupManyRequest, LookupManyResponse, b"lookups")
HANDOFF = Route("handoff", "POST", "/handoff", HandoffRequest, HandoffResponse, b"handoff")
CLAIM = Route("claim", "POST", "/claim", ClaimRequest, ClaimResponse, b"claim")
#: a claim by a claimer that holds the ids already (its inbox had them): the answer leaves them out
ACCEPT = Route("accept", "POST", None, ClaimRequest, AcceptResponse, b"accept")
STATS = Route("stats", "GET", "/stats")
PREFIX_BLOCKS = Route("prefix_blocks", "GET", "/prefix/blocks")
METRICS = Route("metrics", "GET", "/metrics")
REMOTE_AGENT = Route("remote_agent", "GET", "/remote/agent", None, AgentInfo)
REMOTE_CHAIN = Route("remote_chain", "POST", "/remote/chain", LookupRequest, ChainResponse)
REMOTE_CLAIM = Route("remote_claim", "POST", "/remote/claim", RemoteClaimRequest, RemoteClaimResponse)
REMOTE_LOOKUP = Route("remote_lookup", "POST", "/remote/lookup", RemoteLookupRequest, RemoteLookupResponse)

ROUTES: tuple[Route, ...] = (
    HEALTH, ARENA, HELLO, ARENA_FD, OPEN_SESSION, SESSIONS, HEARTBEAT, HELD, CLOSE_SESSION, ALLOC, FREE, COMMIT,
    LOOKUP, LOOKUPS, HANDOFF, CLAIM, ACCEPT, STATS, PREFIX_BLOCKS, METRICS, REMOTE_AGENT, REMOTE_CHAIN, REMOTE_CLAIM,
    REMOTE_LOOKUP,
)  # fmt: skip
