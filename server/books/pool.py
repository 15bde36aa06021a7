"""The pool's books: sessions with leases, block refs, and the parts it owns: the prefix cache
(:mod:`~kvpool.server.books.prefixcache`), parked handoffs (:mod:`~kvpool.server.books.parking`), keyed names
(:mod:`~kvpool.server.books.names`) and, with ``--slabs``, the slab books (:mod:`~kvpool.server.books.slabs`).

This is the whole domain logic of the pool manager, with no HTTP and no torch: the server validates requests
and calls these methods from one event loop, so they need no lock. Refs are held by *holders*: a session
(``s:<id>``) or a parked handoff (``h:<request_id>``); handing off and claiming move refs between holders, so a
block is never unowned and a crashed worker's refs are found and released when its lease runs out.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvpool.errors import InvalidRequest, LimitExceeded, StaleBlock, UnknownSession
from kvpool.layout import KVLayout
from kvpool.server.books.allocator import BlockAllocator
from kvpool.server.books.hosttier import HostTier
from kvpool.server.books.names import NameKeys
from kvpool.server.books.parking import Parking
from kvpool.server.books.peers import PeerCopies, PeerCopy
from kvpool.server.books.poolstats import PoolStats
from kvpool.server.books.prefix import Digest, IndexListener, PrefixHasher, PrefixIndex
from kvpool.server.books.prefixcache import PrefixCache
from kvpool.server.books.processes import Peer
from kvpool.server.books.quarantine import Quarantine
from kvpool.server.books.records import RESERVED, SESSION_ID, Clock, Counters, Handoff, Limits, Session
from kvpool.server.books.slabs import SlabBooks


@dataclass
class Pool(PoolStats):
    """Everything the control plane manages: one arena of ``num_blocks`` blocks, or one per device (a list).

    Block ids are global across arenas; ``arena`` arguments pick where new blocks come from and which arena's
    prefix chains a lookup walks (the same prompt on two GPUs is two different sets of blocks).
    """

    num_blocks: int | Sequence[int]
    layout: KVLayout
    lease_ttl_s: float = 10.0
    handoff_ttl_s: float = 60.0
    #: the longest the pool's clock may move between two of its own readings while the pool runs (the server reads
    #: it at least every sweep); a longer gap was a pause (SIGSTOP, a frozen cgroup, swap, a debugger), and only
    #: this much of it counts towards leases and handoff time-outs. None: every second counts (a test's clock)
    pause_slack_s: float | None = None
    model: str = ""
    clock: Clock = time.monotonic
    epoch: str = field(default_factory=lambda: secrets.token_hex(8))
    digest: Digest | None = None
    on_handoff: Callable[[str], None] | None = None
    on_session_end: Callable[[Session], None] | None = None
    limits: Limits = field(default_factory=Limits)
    index_listener: IndexListener | None = None  # told what the index finds (KV events)
    host_tier: HostTier | None = None  # where evicted prefix blocks go, if anywhere
    #: copies blocks between the arenas (several GPUs): lookups on one arena are served from the others too
    peer_copy: PeerCopy | None = None
    #: the fence (see kvpool.server.books.quarantine); None: a lapsed session's blocks are all released at once
    quarantine: Quarantine | None = None
    #: names the operator pinned to a Unix user (``--names``): name, or a prefix ending in ``*``, -> uid
    pins: dict[str, int] = field(default_factory=dict)
    #: the pool's own user: its processes could stop the pool itself, so they take no per-peer share (the compose
    #: deployment runs every container as it); None: every peer has its share (tests)
    own_uid: int | None = None

    def __post_init__(self) -> None:
        self.paused_s = 0.0  # how long the pool did not run, all pauses together
        if self.pause_slack_s is not None:
            self._wall = self.clock
            self._last_read = self._wall()
            self.clock = self._heard
        self.index = PrefixIndex(self.index_listener)
        tier = self.host_tier
        self._forget = tier.evicted if tier else self.index.remove_block
        self.allocator = BlockAllocator(self.num_blocks, on_evict=self._evicted,
                                        after_evict=tier.flush if tier else None)  # fmt: skip
        if tier is not None:
            tier.bind(self.index, self.allocator)
        for start in self.allocator.starts:
            for block in range(start, start + self.layout.reserved_blocks):
                self.allocator.reserve(RESERVED, block)
        self.arena_sizes = self.allocator.sizes
        multi = len(self.arena_sizes) > 1
        self.peers = PeerCopies(self, self.peer_copy) if self.peer_copy is not None and multi else None
        self.total_blocks = self.allocator.num_blocks
        hasher_args = {} if self.digest is None else {"digest": self.digest}
        namespace = self.layout.namespace(self.model)
        self.hashers = [
            PrefixHasher(namespace if i == 0 else f"{namespace}|arena{i}", self.layout.block_size, **hasher_args)
            for i in range(len(self.arena_sizes))
        ]
        self.sessions: dict[str, Session] = {}
        self.slabs: SlabBooks | None = None  # the slab table's books, once opened (see open_slabs)
        # the calls and books of the parts the pool owns, as its own: a caller names the pool, whichever part keeps them
        self.prefix = prefix = PrefixCache(self)
        self.commit, self.lookup, self.lookup_many = prefix.commit, prefix.lookup, prefix.lookup_many
        self.parking = parking = Parking(self)
        self.handoff, self.claim, self.unclaim = parking.handoff, parking.claim, parking.unclaim
        self.refuse, self.remember_refusal = parking.refuse, parking.remember_refusal
        self.handoffs, self.refused = parking.handoffs, parking.refused
        self.counters = Counters()
        self.limits_exceeded: Counter[str] = Counter()  # calls refused for a per-client limit, by limit
        # Indexes, so that no call and no sweep costs more than what it touches: an attacker's many idle sessions
        # or parked handoffs must not slow anyone else's call down, nor the sweep that expires them.
        self._by_name: dict[str, dict[str, None]] = {}
        self.names = NameKeys(self.pins, self._by_name)
        self._sessions_of: Counter[str] = Counter()  # share -> its live sessions
        self._session_deadlines: list[tuple[float, str]] = []  # a heap; an entry may be older than its lease

    def _heard(self) -> float:
        """The pool's time as it could hear its clients: the clock, less the pauses it slept through.

        A lease counts a client's silence as the pool heard it. A pool that was not running heard nothing, and the
        heartbeats its clients sent meanwhile wait in its sockets: expiring them when it wakes, before it read
        those, would release every healthy session's blocks. So a gap between two readings longer than
        ``pause_slack_s`` counts as that slack alone, and every deadline (kept in this time) moves with the pause.
        """
        wall = self._wall()
        gap = wall - self._last_read
        self._last_read = wall
        assert self.pause_slack_s is not None
        if gap > self.pause_slack_s:
            self.paused_s += gap - self.pause_slack_s
        return wall - self.paused_s

    # -- sessions ---------------------------------------------------------------------------------------

    def open_session(
        self,
        name: str,
        role: str,
        layout: KVLayout | None = None,
        inbox: str | None = None,
        name_key: str | None = None,
        peer: Peer | None = None,
    ) -> Session:
        """A new session called ``name``, opened by ``peer``; with ``name_key``, the name is held under that key,
        and by that peer's share (:attr:`Peer.share`), from then on.

        A name is how producers address handoffs, and any token holder may open a session under any name: a
        stranger (or a second deployment, a worker started twice) could take a consumer's name while it restarts
        and receive what is addressed to it. A name opened with a key can only be opened again with the same key
        and by the same share (another user cannot open it, key or not), also after every session of it ended: the
        pool remembers the last ``NAMES_KEPT`` keyed names of each share apart, so one peer's opens never make it
        forget another's. A name the operator pinned (``--names``) opens only for the user it is pinned to, from
        the pool's first moment, so nobody can take it first.
        """
        self.layout.require(layout)
        if len(self.sessions) >= self.limits.max_sessions:
            raise self.exceeded("max_sessions", f"the pool has {len(self.sessions)} sessions open")
        share = self.share_of(peer)
        if share is not None and self._sessions_of[share] >= self.limits.max_sessions_per_peer:
            raise self.exceeded("max_sessions_per_peer", f"{share} has {self._sessions_of[share]} sessions open")
        digest = self.names.check(name, name_key, peer)
        now = self.clock()
        sid = f"{self.epoch[:8]}-{secrets.token_hex(8)}"
        key = secrets.token_bytes(32) if inbox is not None else b""
        session = Session(sid, name, role, now + self.lease_ttl_s, now, inbox, key, peer=peer)
        self.sessions[sid] = session
        if share is not None:
            self._sessions_of[share] += 1
        self._by_name.setdefault(name, {})[sid] = None
        heapq.heappush(self._session_deadlines, (session.expires_at, sid))
        if digest is not None:
            self.names.keep(name, digest, peer.share if peer is not None else None)
        self.counters.sessions_opened += 1
        return session

    def share_of(self, peer: Peer | None) -> str | None:
        """Whose per-peer bounds a session of ``peer`` counts against; None: the pool-wide bounds only."""
        if peer is None or (peer.address is None and peer.uid == self.own_uid):
            return None
        return peer.share

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
                "heartbeat (its blocks were released; those it had not committed stay out of use until the process "
                "that opened it exits); open a new session"
            )
        session.expires_at = now + self.lease_ttl_s
        return session

    def heartbeat(self, session_id: str, peer: Peer | None = None) -> Session:
        """Extend the lease; a session opened where its process was unknown (TCP) takes the process that renews it
        over a Unix socket: that one holds the session, and could write its blocks."""
        session = self.session(session_id)
        if session.peer is not None and not session.peer.process and peer is not None and peer.process:
            session.peer = replace(peer, address=session.peer.address)  # its share stays the one it opened as
        return session

    def held(self, session_id: str) -> list[int]:
        """The fenced ids of the blocks the session holds, an id once per ref: what a client compares with what it
        knows it holds (a block it holds and does not know of stays held until the session ends)."""
        session = self._live(session_id) or self.session(session_id)  # asking is no heartbeat: no lease extended
        fence_of = self.allocator.fence_of
        return [fence_of[block] for block, refs in self.allocator.refs_of(session.holder).items() for _ in range(refs)]

    def close_session(self, session_id: str) -> int:
        session = self.session(session_id)
        del self.sessions[session_id]
        if self.slabs is not None:  # its slab's handed blocks go to their consumers before its refs are released
            self.slabs.release(session)
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
            blocks = self.allocator.allocate(holder, num_blocks, arena)
        except Exception:
            self.counters.alloc_exhausted += 1
            if self.slabs is not None:  # ask slabs for their idle blocks back
                self.slabs.want_back(exclude=session_id)
            raise
        self.counters.alloc_blocks += num_blocks
        return self.allocator.fenced(blocks)

    def free(self, session_id: str, block_ids: Sequence[int]) -> int:
        holder = self.session(session_id).holder
        self.gives_up(session_id)
        self.allocator.drop(holder, self.unfence(block_ids, holder))
        self.counters.free_requests += 1
        self.counters.free_blocks += len(block_ids)
        return len(block_ids)

    def gives_up(self, session_id: str) -> None:
        """Before a session's call gives up blocks (free, commit, handoff): what its slab handed moves first."""
        if self.slabs is not None:
            self.slabs.settle_session(session_id)

    def open_slabs(self, directory: Path, regions: int, slots: int, box_dir: Path | None) -> SlabBooks:
        """Open the slab table (``--slabs``): from now on sessions may keep reservation slabs."""
        self.slabs = SlabBooks(self, directory, regions, slots, box_dir)
        return self.slabs

    def unfence(self, block_ids: Sequence[int], holder: str | None = None) -> list[int]:
        """The blocks that ids a caller sent name; StaleBlock (409) if one was freed or evicted since it was handed
        out, however the caller came by it (a delayed or replayed message, a lease that ran out); NotOwner unless
        ``holder``, if given, holds them."""
        try:
            return self.allocator.unfence(block_ids, holder)
        except StaleBlock as exc:
            self.counters.stale_refused += 1
            self.counters.stale_ids += len(exc.stale)
            raise

    def _evicted(self, block: int) -> None:
        self._forget(block)
        if self.peers is not None:
            self.peers.evicted(block)

    # -- reclaiming -------------------------------------------------------------------------------------

    def expire(self) -> tuple[int, int]:
        """Release sessions whose lease ran out and handoffs nobody claimed in time.

        It costs what expired (and a look at each live session once a lease), never a pass over everything:
        the sweep runs on the pool's one event loop, and a slow one would expire every other session too.
        """
        self.release_gone()
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
        return dead, self.parking.expire(now)

    def _expire_session(self, session: Session) -> None:
        self.sessions.pop(session.session_id, None)
        if self.slabs is not None:
            self.slabs.release(session)
        self._fence(session)
        self.counters.blocks_reclaimed += self.allocator.release_holder(session.holder)
        self.counters.sessions_expired += 1
        self._ended(session)

    def _fence(self, session: Session) -> None:
        """Move what a lapsed session could still write (its uncommitted blocks) to the quarantine, if its process
        is known; the rest (committed blocks: immutable) is released as before."""
        if self.quarantine is None:
            return
        committed = self.allocator.committed
        writable: list[int] = []
        released = 0
        for block, refs in self.allocator.refs_of(session.holder).items():
            if committed[block]:
                released += refs
            else:
                writable += [block] * refs
        holder = self.quarantine.lapsed(session.session_id, session.name, session.peer, writable, released)
        if holder is not None:
            self.allocator.transfer(session.holder, holder, writable)

    def release_gone(self) -> int:
        """Release the quarantined blocks of lapsed processes that are gone; how many blocks reached ref 0."""
        if self.quarantine is None or not self.quarantine.fenced:
            return 0
        released = 0
        for entry in self.quarantine.gone():
            released += self.allocator.release_holder(entry.holder)
        self.counters.blocks_reclaimed += released
        return released

    def _ended(self, session: Session) -> None:
        """Handoffs addressed to a session that ended are refused, and their blocks released.

        They were addressed to that session, not to its name: giving them to whoever holds the name next (the worker
        restarted, or anyone else) or to anyone at all would hand a request to a session its producer never chose.
        The refusal is kept, so a claim of one (by a restarted consumer, or its producer asking) says why.
        """
        sid = session.session_id
        share = self.share_of(session.peer)
        if share is not None:
            self._sessions_of[share] -= 1
            if not self._sessions_of[share]:
                del self._sessions_of[share]
        named = self._by_name.get(session.name)
        if named is not None:
            named.pop(sid, None)
            if not named:
                del self._by_name[session.name]
        self.parking.ended(session)
        if self.on_session_end is not None:
            self.on_session_end(session)
