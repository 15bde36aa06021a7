"""The pool's books: sessions with leases, block refs, the prefix index and parked handoffs.

This is the whole domain logic of the pool manager, with no HTTP and no torch: the server validates requests
and calls these methods from one event loop, so they need no lock. Refs are held by *holders*: a session
(``s:<id>``) or a parked handoff (``h:<request_id>``); handing off and claiming move refs between holders, so a
block is never unowned and a crashed worker's refs are found and released when its lease runs out.
"""

from __future__ import annotations

import heapq
import json
import re
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.server.allocator import BlockAllocator
from kvpool.server.prefix import Digest, PrefixHasher, PrefixIndex

from kvpool.errors import (
    HandoffExists,
    HandoffNotFound,
    HandoffRefused,
    InvalidRequest,
    KvpoolError,
    LimitExceeded,
    NotOwner,
    UnknownSession,
)
from kvpool.layout import KVLayout

Clock = Callable[[], float]
REFUSALS_KEPT = 4096
#: the shape of every session id a pool makes: its epoch's first 8 hex digits, a dash, a random part
SESSION_ID = re.compile(r"[0-9a-f]{8}-[0-9A-Za-z_-]+")


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one client can make the pool hold; each is a setting of ``kvpool serve`` (same name)."""

    max_sessions: int = 1024
    max_handoffs: int = 65536
    max_handoffs_per_session: int = 4096
    max_meta_bytes: int = 16 << 10
    max_claims_per_session: int = 64

    def exceeded(self, name: str, what: str) -> LimitExceeded:
        flag, env = "--" + name.replace("_", "-"), "KVPOOL_" + name.upper()
        return LimitExceeded(f"{what}: the limit is {getattr(self, name)} ({flag}, {env}); wait, or raise it")


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

    @property
    def holder(self) -> str:
        return f"s:{self.session_id}"


@dataclass(slots=True)
class Handoff:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    meta: dict[str, Any]
    from_session: str
    expires_at: float
    ttl_s: float
    to: str | None = None  # the one session that may claim it; None: any. Addressed, it does not expire.
    seq: int = 0
    meta_json: bytes = b""  # meta as compact JSON (empty for {}): what its size limit and a delivery's seal cover

    @property
    def holder(self) -> str:
        return f"h:{self.request_id}"

    def claimable_by(self, session_id: str) -> bool:
        return self.to is None or self.to == session_id


@dataclass(slots=True)
class Refusal:
    why: str
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
    blocks_reclaimed: int = 0


@dataclass(slots=True)
class LookupResult:
    block_ids: list[int]
    num_tokens: int


@dataclass(slots=True)
class CommitResult:
    committed: int
    duplicates: int
    num_blocks: int


@dataclass
class Pool:
    """Everything the control plane manages: one arena of ``num_blocks`` blocks, or one per device (a list).

    Block ids are global across arenas; ``arena`` arguments pick where new blocks come from and which arena's
    prefix chains a lookup walks (the same prompt on two GPUs is two different sets of blocks).
    """

    num_blocks: int | Sequence[int]
    layout: KVLayout
    lease_ttl_s: float = 10.0
    handoff_ttl_s: float = 60.0
    model: str = ""
    clock: Clock = time.monotonic
    epoch: str = field(default_factory=lambda: secrets.token_hex(8))
    digest: Digest | None = None
    on_handoff: Callable[[str], None] | None = None
    on_session_end: Callable[[Session], None] | None = None
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        self.index = PrefixIndex()
        self.allocator = BlockAllocator(self.num_blocks, on_evict=self.index.remove_block)
        self.arena_sizes = self.allocator.sizes
        self.total_blocks = self.allocator.num_blocks
        hasher_args = {} if self.digest is None else {"digest": self.digest}
        namespace = self.layout.namespace(self.model)
        self.hashers = [
            PrefixHasher(namespace if i == 0 else f"{namespace}|arena{i}", self.layout.block_size, **hasher_args)
            for i in range(len(self.arena_sizes))
        ]
        self.sessions: dict[str, Session] = {}
        self.handoffs: dict[str, Handoff] = {}
        self.refused: OrderedDict[str, Refusal] = OrderedDict()  # addressed handoffs refused lately, by request
        self.counters = Counters()
        self.limits_exceeded: Counter[str] = Counter()  # calls refused for a per-client limit, by limit
        # Indexes, so that no call and no sweep costs more than what it touches: an attacker's many idle sessions
        # or parked handoffs must not slow anyone else's call down, nor the sweep that expires them.
        self._by_name: dict[str, dict[str, None]] = {}
        self._open: dict[str, None] = {}  # handoffs anyone may claim, oldest first
        self._addressed: dict[str, dict[str, None]] = {}  # addressee -> its handoffs, oldest first
        self._parked_by: dict[str, set[str]] = {}  # live producer -> the handoffs it parked that are still parked
        self._session_deadlines: list[tuple[float, str]] = []  # a heap; an entry may be older than its lease
        self._handoff_deadlines: list[tuple[float, int, str]] = []  # a heap of anyone's handoffs; stale entries ok
        self._seq = 0

    # -- sessions ---------------------------------------------------------------------------------------

    def open_session(self, name: str, role: str, layout: KVLayout | None = None, inbox: str | None = None) -> Session:
        self.layout.require(layout)
        if len(self.sessions) >= self.limits.max_sessions:
            raise self.exceeded("max_sessions", f"the pool has {len(self.sessions)} sessions open")
        now = self.clock()
        sid = f"{self.epoch[:8]}-{secrets.token_hex(8)}"
        key = secrets.token_bytes(32) if inbox is not None else b""
        session = Session(sid, name, role, now + self.lease_ttl_s, now, inbox, key)
        self.sessions[sid] = session
        self._by_name.setdefault(name, {})[sid] = None
        heapq.heappush(self._session_deadlines, (session.expires_at, sid))
        self.counters.sessions_opened += 1
        return session

    def session(self, session_id: str) -> Session:
        """The live session, its lease extended by any call it makes."""
        session = self.sessions.get(session_id)
        now = self.clock()
        if session is None or session.expires_at < now:
            if session is not None:
                self._expire_session(session)
            if not SESSION_ID.fullmatch(session_id):
                raise UnknownSession(
                    f"unknown session {session_id!r}: malformed, no pool makes ids like it; a session id is what "
                    "POST /sessions returned (like 0123abcd-0123456789abcdef)"
                )
            if not session_id.startswith(self.epoch[:8]):
                raise UnknownSession(
                    f"unknown session {session_id!r}: it belongs to another pool epoch (this pool is "
                    f"{self.epoch}); the pool restarted, open a new session and map the arena again"
                )
            raise UnknownSession(
                f"unknown session {session_id!r}: closed, or expired after {self.lease_ttl_s}s without a "
                "heartbeat (its blocks were released); open a new session"
            )
        session.expires_at = now + self.lease_ttl_s
        return session

    def heartbeat(self, session_id: str) -> Session:
        return self.session(session_id)

    def close_session(self, session_id: str) -> int:
        session = self.session(session_id)
        del self.sessions[session_id]
        released = self.allocator.release_holder(session.holder)
        self._ended(session)
        return released

    def addressee(self, handoff: Handoff) -> Session | None:
        """The session a handoff is addressed to, if it is open (its lease may have run out since the last sweep)."""
        return self.sessions.get(handoff.to) if handoff.to is not None else None

    def live_sessions(self, name: str | None = None) -> list[Session]:
        """Sessions whose lease has not run out (the sweep may not have removed the others yet), by name."""
        now = self.clock()
        if name is None:
            return [s for s in self.sessions.values() if s.expires_at >= now]
        found = (self.sessions[sid] for sid in self._by_name.get(name, ()))
        return [s for s in found if s.expires_at >= now]

    def exceeded(self, limit: str, what: str) -> LimitExceeded:
        """The refusal of a call past ``limit``, counted (``kvpool_limits_exceeded``): a client hitting a bound."""
        self.limits_exceeded[limit] += 1
        return self.limits.exceeded(limit, what)

    def _live(self, session_id: str) -> Session | None:
        """The session if it is live, without extending its lease (for calls made by someone else)."""
        session = self.sessions.get(session_id)
        return session if session is not None and session.expires_at >= self.clock() else None

    def named(self, name: str) -> Session:
        """The one live session called ``name`` (the addressee of a handoff)."""
        found = self.live_sessions(name)
        if len(found) != 1:
            why = "no live session is" if not found else f"{len(found)} live sessions are"
            raise InvalidRequest(
                f"{why} named {name!r}: address a handoff to a worker that is up, under a name it alone has"
            )
        return found[0]

    # -- blocks -----------------------------------------------------------------------------------------

    def alloc(self, session_id: str, num_blocks: int, arena: int = 0) -> list[int]:
        holder = self.session(session_id).holder
        self.counters.alloc_requests += 1
        try:
            ids = self.allocator.allocate(holder, num_blocks, arena)
        except Exception:
            self.counters.alloc_exhausted += 1
            raise
        self.counters.alloc_blocks += num_blocks
        return ids

    def free(self, session_id: str, block_ids: Sequence[int]) -> int:
        holder = self.session(session_id).holder
        self.allocator.free(holder, block_ids)
        self.counters.free_requests += 1
        self.counters.free_blocks += len(block_ids)
        return len(block_ids)

    # -- prefix cache -----------------------------------------------------------------------------------

    def commit(self, session_id: str, block_ids: Sequence[int], token_ids: Sequence[int]) -> CommitResult:
        """Index the full blocks of ``token_ids``, held in ``block_ids`` (block i holds tokens i*bs..)."""
        holder = self.session(session_id).holder
        num_full = len(token_ids) // self.layout.block_size
        if len(block_ids) < num_full:
            raise InvalidRequest(
                f"token_ids fill {num_full} blocks of {self.layout.block_size} tokens but only "
                f"{len(block_ids)} block ids were given"
            )
        if len(set(block_ids)) != len(block_ids):
            raise InvalidRequest("block_ids lists a block twice: each block holds one span of tokens")
        self.allocator.check_held(holder, block_ids)
        blocks = list(block_ids[:num_full])
        if not blocks:
            return CommitResult(committed=0, duplicates=0, num_blocks=0)
        arena = 0
        if len(self.arena_sizes) > 1:
            arenas = {self.allocator.arena_of[b] for b in blocks}
            if len(arenas) > 1:
                raise InvalidRequest("a committed prefix must sit in one arena: these blocks span several devices")
            arena = arenas.pop()
        new = self.index.plan(self.hashers[arena].blocks(token_ids), blocks)
        self.allocator.mark_committed([node.block for node in new])
        self.index.apply(new)
        c = self.counters
        c.commit_requests += 1
        c.committed_blocks += len(new)
        c.duplicate_blocks += num_full - len(new)
        return CommitResult(committed=len(new), duplicates=num_full - len(new), num_blocks=num_full)

    def lookup(self, session_id: str, token_ids: Sequence[int], arena: int = 0) -> LookupResult:
        """The longest cached prefix of ``token_ids`` in ``arena``, with a ref taken on each block for the session."""
        holder = self.session(session_id).holder
        if not 0 <= arena < len(self.hashers):
            raise InvalidRequest(f"no arena {arena}: the pool has {len(self.hashers)}")
        ids = self.index.match(self.hashers[arena].blocks(token_ids))
        self.allocator.acquire(holder, ids)
        c = self.counters
        c.lookup_requests += 1
        c.lookup_blocks += len(token_ids) // self.layout.block_size
        c.hit_blocks += len(ids)
        return LookupResult(ids, len(ids) * self.layout.block_size)

    # -- handoffs ---------------------------------------------------------------------------------------

    def handoff(
        self,
        session_id: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        meta: dict[str, Any] | None = None,
        ttl_s: float | None = None,
        to: str | None = None,
    ) -> Handoff:
        """Park the blocks under ``request_id``, moving the session's refs to the handoff.

        ``to`` names the one session that may claim it. The pool may deliver it the ids at once (to its inbox), and
        it may read them before its claim reaches the pool, so an addressed handoff is held for its addressee for
        as long as that session lives: it does not expire, and no other session may claim it. When the addressee
        ends, the handoff is anyone's and its time-to-live starts. If such a handoff is refused, the refusal is kept
        a while: the addressee's claim of it fails at once with the reason.
        """
        session: Session | None = None
        limits = self.limits
        try:
            session = self.session(session_id)
            if request_id in self.handoffs:
                raise HandoffExists(f"request {request_id!r} is already parked: claim it first or use another id")
            refusal = self.refused.get(request_id)
            if refusal is not None and refusal.seen:
                raise HandoffRefused(
                    f"request {request_id!r} was refused before ({refusal.why}), and its claimer was told so and "
                    "dropped it: hand it off under a new request id"
                )
            max_tokens = len(block_ids) * self.layout.block_size
            if num_tokens > max_tokens:
                raise InvalidRequest(
                    f"num_tokens {num_tokens} does not fit in {len(block_ids)} blocks of {self.layout.block_size}"
                )
            meta_json = json.dumps(meta, separators=(",", ":")).encode() if meta else b""
            if len(meta_json) > limits.max_meta_bytes:
                raise self.exceeded("max_meta_bytes", f"meta is {len(meta_json)} bytes of JSON")
            if len(self.handoffs) >= limits.max_handoffs:
                raise self.exceeded("max_handoffs", f"the pool holds {len(self.handoffs)} parked handoffs")
            mine = self._parked_by.get(session_id, ())
            if len(mine) >= limits.max_handoffs_per_session:
                raise self.exceeded("max_handoffs_per_session", f"this session has {len(mine)} handoffs parked")
            addressee = None if to is None else self.named(to).session_id
            waiting = self._addressed.get(addressee or "", ())
            if len(waiting) >= limits.max_handoffs_per_session:
                raise self.exceeded("max_handoffs_per_session", f"{len(waiting)} handoffs wait for {to!r}")
            ttl = self.handoff_ttl_s if ttl_s is None else ttl_s
            self._seq += 1
            handoff = Handoff(
                request_id=request_id,
                block_ids=list(block_ids),
                num_tokens=num_tokens,
                meta=dict(meta or {}),
                from_session=session_id,
                expires_at=self.clock() + ttl,
                ttl_s=ttl,
                to=addressee,
                seq=self._seq,
                meta_json=meta_json,
            )
            self.allocator.transfer(session.holder, handoff.holder, handoff.block_ids)
        except KvpoolError as exc:
            if to is not None and session is not None and not isinstance(exc, (HandoffExists, HandoffRefused)):
                self.refuse(request_id, f"{type(exc).__name__}: {exc}", session_id)
            raise
        self.refused.pop(request_id, None)
        self._park(handoff)
        self._parked_by.setdefault(session_id, set()).add(request_id)
        self.counters.handoffs += 1
        if self.on_handoff is not None:
            self.on_handoff(request_id)
        return handoff

    def _park(self, handoff: Handoff) -> None:
        rid = handoff.request_id
        self.handoffs[rid] = handoff
        if handoff.to is None:
            self._open[rid] = None
            self._push_deadline(handoff)
        else:
            self._addressed.setdefault(handoff.to, {})[rid] = None

    def _unpark(self, handoff: Handoff) -> None:
        rid = handoff.request_id
        del self.handoffs[rid]
        self._open.pop(rid, None)
        if handoff.to is not None:
            waiting = self._addressed.get(handoff.to)
            if waiting is not None:
                waiting.pop(rid, None)
                if not waiting:
                    del self._addressed[handoff.to]
        mine = self._parked_by.get(handoff.from_session)
        if mine is not None:
            mine.discard(rid)

    def _push_deadline(self, handoff: Handoff) -> None:
        heap = self._handoff_deadlines
        heapq.heappush(heap, (handoff.expires_at, handoff.seq, handoff.request_id))
        if len(heap) > 2 * len(self._open) + 1024:  # claimed handoffs leave entries behind: drop them now and then
            live = (self.handoffs[r] for r in self._open)
            self._handoff_deadlines = [(h.expires_at, h.seq, h.request_id) for h in live]
            heapq.heapify(self._handoff_deadlines)

    def refuse(self, request_id: str, why: str, by: str) -> None:
        """Keep a while that an addressed handoff of ``request_id`` was refused, and wake its claimers to say so.

        Only a live session's failed handoff counts: anyone else could otherwise fail any request's claim
        before its producer parks it.
        """
        if request_id in self.handoffs or self._live(by) is None:
            return  # one of that id is parked, and it stands; or the caller is no session of this pool
        self.refused[request_id] = Refusal(why)
        while len(self.refused) > REFUSALS_KEPT:
            self.refused.popitem(last=False)
        if self.on_handoff is not None:
            self.on_handoff(request_id)

    def claim(self, session_id: str, request_id: str | None = None) -> Handoff:
        """Take a parked handoff (the oldest one if ``request_id`` is None), moving its refs to the session."""
        session = self.session(session_id)
        if request_id is None:
            request_id = self._oldest_for(session_id)
            if request_id is None:
                raise HandoffNotFound("no handoff is parked for this session")
        handoff = self.handoffs.get(request_id)
        if handoff is None:
            refusal = self.refused.get(request_id)
            if refusal is not None:
                refusal.seen = True
                raise HandoffRefused(
                    f"the handoff of request {request_id!r} was refused when its producer made it ({refusal.why}): "
                    "any ids you were sent for it are not yours; drop the request"
                )
            raise HandoffNotFound(f"no handoff is parked under request {request_id!r}")
        if not self._claimable(handoff, session_id):
            addressee = self.sessions.get(handoff.to or "")
            raise NotOwner(
                f"request {request_id!r} is addressed to session {addressee.name if addressee else '?'!r}: "
                "only it may claim it"
            )
        self.allocator.transfer(handoff.holder, session.holder, handoff.block_ids)
        self._unpark(handoff)
        self.counters.claims += 1
        return handoff

    def unclaim(self, session_id: str, handoff: Handoff) -> bool:
        """Park a claimed handoff again, as it was, when its claimer went away before it could learn of it.

        Only while the session still holds those blocks and nothing took the request id since; whether it did.
        """
        session = self.sessions.get(session_id)
        if session is None or handoff.request_id in self.handoffs:
            return False
        try:
            self.allocator.transfer(session.holder, handoff.holder, handoff.block_ids)
        except KvpoolError:
            return False
        if handoff.to is not None and handoff.to not in self.sessions:
            handoff.to = None
        self._park(handoff)
        mine = self._parked_by.get(handoff.from_session)
        if mine is not None:
            mine.add(handoff.request_id)
        self.counters.claims -= 1
        if self.on_handoff is not None:
            self.on_handoff(handoff.request_id)
        return True

    def _oldest_for(self, session_id: str) -> str | None:
        """The oldest handoff the session may claim: addressed to it, or to nobody."""
        mine = next(iter(self._addressed.get(session_id, ())), None)
        anyones = next(iter(self._open), None)
        if mine is None or anyones is None:
            return mine or anyones
        return mine if self.handoffs[mine].seq < self.handoffs[anyones].seq else anyones

    def _claimable(self, handoff: Handoff, session_id: str) -> bool:
        """Whether the session may claim it: addressed to it or to no one, or its addressee's lease ran out."""
        if handoff.claimable_by(session_id):
            return True
        addressee = self.sessions.get(handoff.to or "")
        if addressee is not None and addressee.expires_at < self.clock():
            self._expire_session(addressee)  # as session() does for a caller: the sweep may not have come by yet
        return handoff.claimable_by(session_id)

    # -- reclaiming -------------------------------------------------------------------------------------

    def expire(self) -> tuple[int, int]:
        """Release sessions whose lease ran out and handoffs nobody claimed in time.

        It costs what expired (and a look at each live session once a lease), never a pass over everything:
        the sweep runs on the pool's one event loop, and a slow one would expire every other session too.
        """
        now = self.clock()
        dead = 0
        heap = self._session_deadlines
        while heap and heap[0][0] < now:
            _, sid = heapq.heappop(heap)
            session = self.sessions.get(sid)
            if session is None:
                continue
            if session.expires_at < now:
                self._expire_session(session)
                dead += 1
            else:  # it renewed its lease since this entry was made
                heapq.heappush(heap, (session.expires_at, sid))
        stale = 0
        heap = self._handoff_deadlines
        while heap and heap[0][0] < now:
            _, seq, rid = heapq.heappop(heap)
            handoff = self.handoffs.get(rid)
            if handoff is None or handoff.seq != seq or handoff.to is not None or handoff.expires_at >= now:
                continue
            self._unpark(handoff)
            self.counters.blocks_reclaimed += self.allocator.release_holder(handoff.holder)
            self.counters.handoffs_expired += 1
            stale += 1
        return dead, stale

    def _expire_session(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)
        self.counters.blocks_reclaimed += self.allocator.release_holder(session.holder)
        self.counters.sessions_expired += 1
        self._ended(session)

    def _ended(self, session: Session) -> None:
        """Handoffs addressed to a session that ended become anyone's, with their time-to-live started anew."""
        sid, now = session.session_id, self.clock()
        named = self._by_name.get(session.name)
        if named is not None:
            named.pop(sid, None)
            if not named:
                del self._by_name[session.name]
        self._parked_by.pop(sid, None)  # what it parked stays parked, and counts against the pool's limit only
        freed = list(self._addressed.pop(sid, ()))
        for request_id in freed:
            handoff = self.handoffs[request_id]
            handoff.to = None
            handoff.expires_at = now + handoff.ttl_s
            self._open[request_id] = None
            self._push_deadline(handoff)
        if self.on_session_end is not None:
            self.on_session_end(session)
        if freed and self.on_handoff is not None:
            for request_id in freed:
                self.on_handoff(request_id)

    # -- introspection ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        a, c = self.allocator, self.counters
        return {
            "epoch": self.epoch,
            "num_blocks": self.total_blocks,
            "free": a.num_free,
            "in_use": a.num_in_use,
            "cached": a.num_cached,
            "indexed": len(self.index),
            "sessions": len(self.sessions),
            "handoffs": len(self.handoffs),
            "hit_rate": c.hit_blocks / c.lookup_blocks if c.lookup_blocks else 0.0,
            "evictions": a.num_evictions,
            "counters": {name: getattr(c, name) for name in Counters.__slots__},
            "limits_exceeded": dict(self.limits_exceeded),
            "arenas": [
                dict(zip(("free", "in_use", "cached"), a.counts(i), strict=True)) for i in range(len(self.arena_sizes))
            ],
        }
