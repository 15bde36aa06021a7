"""The handoff half of the books: parking blocks under a request id, claiming them, and refusals.

The pool owns one :class:`Parking` beside its sessions and its allocator, and asks it to park, claim and expire.
"""

from __future__ import annotations

import heapq
import json
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

from kvpool.errors import (
    HandoffExists,
    HandoffNotFound,
    HandoffRefused,
    InvalidRequest,
    KvpoolError,
    NotOwner,
    PayloadTooLarge,
)
from kvpool.server.books.records import REFUSALS_KEPT, Handoff, Refusal, Session

#: the :class:`kvpool.server.books.pool.Pool` that owns this part (it imports this module, so not the other way)
Pool = Any


class Parking:
    """The parked handoffs of a :class:`~kvpool.server.books.pool.Pool`, and their indexes: which anyone may claim,
    which wait for an addressee, which a producer parked, and when the unaddressed ones expire. The pool owns it;
    sessions, refs and limits stay the pool's, and a handoff's refs move in its allocator."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.handoffs: dict[str, Handoff] = {}
        self.refused: OrderedDict[str, Refusal] = OrderedDict()  # addressed handoffs refused lately, by request
        self.handoffs_of: Counter[str] = Counter()  # share -> the handoffs its sessions parked, still parked
        self.open: dict[str, None] = {}  # handoffs anyone may claim, oldest first
        self.sealed: dict[str, None] = {}  # handoffs to nobody that only a claim naming them takes
        self.addressed: dict[str, dict[str, None]] = {}  # addressee -> its handoffs, oldest first
        self.sealed_to: dict[str, dict[str, None]] = {}  # addressee -> those of its handoffs it must name
        self.parked_by: dict[str, set[str]] = {}  # live producer -> the handoffs it parked that are still parked
        self.deadlines: list[tuple[float, int, str]] = []  # a heap of anyone's handoffs; stale entries ok
        self.seq = 0

    def handoff(
        self,
        session_id: str,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        meta: dict[str, Any] | None = None,
        ttl_s: float | None = None,
        to: str | None = None,
        keep: bool = False,
        sealed: bool = False,
    ) -> Handoff:
        """Park the blocks under ``request_id``, moving the session's refs to the handoff (``keep``: the handoff
        takes refs of its own on blocks the session holds, and the session keeps its refs: a producer that still uses
        the blocks, as a resident engine does while other requests share them).

        ``sealed``: only a claim that names ``request_id`` takes it (a claim of the oldest handoff never does), so a
        producer that parks under an unguessable id hands it to whoever it tells that id, and nobody else.

        ``to`` names the one session that may claim it: the one live session of that name now. The pool may deliver
        it the ids at once (to its inbox), and it may read them before its claim reaches the pool, so an addressed
        handoff is held for its addressee for as long as that session lives: it does not expire, and no other
        session may claim it. When the addressee ends first, the handoff is refused and its blocks released
        (:meth:`Pool._ended`), never given to another session. If such a handoff is refused, the refusal is kept a
        while: a claim of it fails at once with the reason.
        """
        pool = self.pool
        session: Session | None = None
        limits = pool.limits
        try:
            session = pool.session(session_id)
            pool.gives_up(session_id)
            if request_id in self.handoffs:
                raise HandoffExists(f"request {request_id!r} is already parked: claim it first or use another id")
            refusal = self.refused.get(request_id)
            if refusal is not None and refusal.seen:
                raise HandoffRefused(
                    f"request {request_id!r} was refused before ({refusal.why}), and its claimer was told so and "
                    "dropped it: hand it off under a new request id"
                )
            if not block_ids:
                raise InvalidRequest("a handoff carries at least one block: hand off the blocks of the request's KV")
            max_tokens = len(block_ids) * pool.layout.block_size
            if num_tokens > max_tokens:
                raise InvalidRequest(
                    f"num_tokens {num_tokens} does not fit in {len(block_ids)} blocks of {pool.layout.block_size}"
                )
            meta_json = json.dumps(meta, separators=(",", ":")).encode() if meta else b""
            if len(meta_json) > limits.max_meta_bytes:
                pool.limits_exceeded["max_meta_bytes"] += 1
                raise PayloadTooLarge(
                    f"meta is {len(meta_json)} bytes of JSON, over the limit of {limits.max_meta_bytes} "
                    "(--max-meta-bytes, KVPOOL_MAX_META_BYTES): send less meta, or raise the limit"
                )
            if len(self.handoffs) >= limits.max_handoffs:
                raise pool.exceeded("max_handoffs", f"the pool holds {len(self.handoffs)} parked handoffs")
            share = pool.share_of(session.peer)
            if share is not None and self.handoffs_of[share] >= limits.max_handoffs_per_peer:
                raise pool.exceeded("max_handoffs_per_peer", f"{share} has {self.handoffs_of[share]} handoffs parked")
            mine = self.parked_by.get(session_id, ())
            if len(mine) >= limits.max_handoffs_per_session:
                raise pool.exceeded("max_handoffs_per_session", f"this session has {len(mine)} handoffs parked")
            addressee = None if to is None else pool.named(to).session_id
            waiting = len(self.addressed.get(addressee or "", ())) + len(self.sealed_to.get(addressee or "", ()))
            if waiting >= limits.max_handoffs_per_session:
                raise pool.exceeded("max_handoffs_per_session", f"{waiting} handoffs wait for {to!r}")
            blocks = pool.unfence(block_ids)
            ttl = pool.handoff_ttl_s if ttl_s is None else ttl_s
            self.seq += 1
            handoff = Handoff(
                request_id=request_id,
                block_ids=list(block_ids),
                num_tokens=num_tokens,
                meta=dict(meta or {}),
                from_session=session_id,
                expires_at=pool.clock() + ttl,
                ttl_s=ttl,
                to=addressee,
                seq=self.seq,
                meta_json=meta_json,
                blocks=blocks,
                sealed=sealed,
                parked_by=session.name,
                share=share,
            )
            if keep:
                pool.allocator.check_held(session.holder, blocks)
                loose = [b for b in blocks if not pool.allocator.committed[b]]
                if loose:  # a block two parties hold must be one neither writes again
                    raise InvalidRequest(
                        f"keep shares committed blocks only, and blocks {loose[:8]} are not committed (or were "
                        "duplicates of blocks the index held): commit them first, or hand them off without keep"
                    )
                pool.allocator.acquire(handoff.holder, blocks)
            else:
                pool.allocator.transfer(session.holder, handoff.holder, blocks)
        except KvpoolError as exc:
            if to is not None and session is not None and not isinstance(exc, (HandoffExists, HandoffRefused)):
                self.refuse(request_id, f"{type(exc).__name__}: {exc}", session_id)
            raise
        self.refused.pop(request_id, None)
        self.park(handoff)
        self.parked_by.setdefault(session_id, set()).add(request_id)
        pool.counters.handoffs += 1
        if pool.on_handoff is not None:
            pool.on_handoff(request_id)
        return handoff

    def park(self, handoff: Handoff) -> None:
        rid = handoff.request_id
        self.handoffs[rid] = handoff
        if handoff.share is not None:
            self.handoffs_of[handoff.share] += 1
        if handoff.to is None:
            (self.sealed if handoff.sealed else self.open)[rid] = None
            self.push_deadline(handoff)
        else:
            (self.sealed_to if handoff.sealed else self.addressed).setdefault(handoff.to, {})[rid] = None

    def unpark(self, handoff: Handoff) -> None:
        rid = handoff.request_id
        del self.handoffs[rid]
        if handoff.share is not None:
            self.handoffs_of[handoff.share] -= 1
            if not self.handoffs_of[handoff.share]:
                del self.handoffs_of[handoff.share]
        self.open.pop(rid, None)
        self.sealed.pop(rid, None)
        if handoff.to is not None:
            by_addressee = self.sealed_to if handoff.sealed else self.addressed
            waiting = by_addressee.get(handoff.to)
            if waiting is not None:
                waiting.pop(rid, None)
                if not waiting:
                    del by_addressee[handoff.to]
        mine = self.parked_by.get(handoff.from_session)
        if mine is not None:
            mine.discard(rid)

    def push_deadline(self, handoff: Handoff) -> None:
        heap = self.deadlines
        heapq.heappush(heap, (handoff.expires_at, handoff.seq, handoff.request_id))
        unaddressed = len(self.open) + len(self.sealed)
        if len(heap) > 2 * unaddressed + 1024:  # claimed handoffs leave entries behind: drop them now and then
            live = (self.handoffs[r] for r in (*self.open, *self.sealed))
            self.deadlines = [(h.expires_at, h.seq, h.request_id) for h in live]
            heapq.heapify(self.deadlines)

    def refuse(self, request_id: str, why: str, by: str) -> None:
        """Keep a while that an addressed handoff of ``request_id`` was refused, and wake its claimers to say so.

        Only a live session's failed handoff counts: anyone else could otherwise fail any request's claim
        before its producer parks it.
        """
        if request_id in self.handoffs or self.pool._live(by) is None:
            return  # one of that id is parked, and it stands; or the caller is no session of this pool
        self.remember_refusal(request_id, why)

    def remember_refusal(self, request_id: str, why: str, when: str | None = None) -> None:
        """Keep the last ``REFUSALS_KEPT`` refusals, for the claims of their requests (which wake now) to tell."""
        self.refused[request_id] = Refusal(why) if when is None else Refusal(why, when)
        self.refused.move_to_end(request_id)
        while len(self.refused) > REFUSALS_KEPT:
            self.refused.popitem(last=False)
        if self.pool.on_handoff is not None:
            self.pool.on_handoff(request_id)

    def claim(self, session_id: str, request_id: str | None = None) -> Handoff:
        """Take a parked handoff (the oldest one if ``request_id`` is None), moving its refs to the session.

        A handoff addressed to another session is not this one's to take: while that session lives, the claim is
        refused (NotOwner, which tells a producer that asks that its consumer has not claimed it yet); once it has
        ended, the handoff was refused with it, and so is the claim (HandoffRefused, with why).
        """
        session = self.pool.session(session_id)
        if request_id is None:
            request_id = self.oldest_for(session_id)
            if request_id is None:
                raise HandoffNotFound("no handoff is parked for this session")
        handoff = self.handoffs.get(request_id)
        if handoff is not None and not handoff.claimable_by(session_id):
            addressee = self.pool.sessions.get(handoff.to or "")
            if addressee is None or addressee.expires_at >= self.pool.clock():
                raise NotOwner(
                    f"request {request_id!r} is addressed to session {addressee.name if addressee else '?'!r}: "
                    "only it may claim it"
                )
            self.pool._expire_session(addressee)  # as session() does for a caller: the sweep may not have come by yet
            handoff = None  # refused with its addressee
        if handoff is None:
            refusal = self.refused.get(request_id)
            if refusal is not None:
                refusal.seen = True
                raise HandoffRefused(
                    f"the handoff of request {request_id!r} was refused {refusal.when} ({refusal.why}): any ids you "
                    "were sent for it are not yours; drop the request (its producer may hand it off again under a "
                    "new request id)"
                )
            raise HandoffNotFound(f"no handoff is parked under request {request_id!r}")
        self.pool.allocator.transfer(handoff.holder, session.holder, handoff.blocks)
        self.unpark(handoff)
        self.pool.counters.claims += 1
        return handoff

    def unclaim(self, session_id: str, handoff: Handoff) -> bool:
        """Park a claimed handoff again, as it was, when its claimer went away before it could learn of it.

        Only while the session still holds those blocks and nothing took the request id since; whether it did.
        """
        session = self.pool.sessions.get(session_id)
        if session is None or handoff.request_id in self.handoffs:
            return False
        try:
            self.pool.allocator.transfer(session.holder, handoff.holder, handoff.blocks)
        except KvpoolError:
            return False
        self.park(handoff)  # addressed, it was to this session, which lives
        mine = self.parked_by.get(handoff.from_session)
        if mine is not None:
            mine.add(handoff.request_id)
        self.pool.counters.claims -= 1
        if self.pool.on_handoff is not None:
            self.pool.on_handoff(handoff.request_id)
        return True

    def oldest_for(self, session_id: str) -> str | None:
        """The oldest handoff the session may claim without naming it: addressed to it, or to nobody, and not
        sealed (a sealed one addressed to it waits for a claim that names it)."""
        mine = next(iter(self.addressed.get(session_id, ())), None)
        anyones = next(iter(self.open), None)
        if mine is None or anyones is None:
            return mine or anyones
        return mine if self.handoffs[mine].seq < self.handoffs[anyones].seq else anyones

    def expire(self, now: float) -> int:
        """Release the handoffs to nobody that nobody claimed by ``now``; how many."""
        stale = 0
        heap = self.deadlines
        while heap and heap[0][0] < now:
            _, seq, rid = heapq.heappop(heap)
            handoff = self.handoffs.get(rid)
            if handoff is None or handoff.seq != seq or handoff.to is not None or handoff.expires_at >= now:
                continue
            self.unpark(handoff)
            self.pool.counters.blocks_reclaimed += self.pool.allocator.release_holder(handoff.holder)
            self.pool.counters.handoffs_expired += 1
            stale += 1
        return stale

    def ended(self, session: Session) -> None:
        """Refuse the handoffs addressed to a session that ended, and release their blocks (see
        :meth:`Pool._ended`); what it parked stays parked, and counts against the pool's limit only."""
        sid = session.session_id
        self.parked_by.pop(sid, None)
        orphaned = [*self.addressed.pop(sid, ()), *self.sealed_to.pop(sid, ())]
        why = f"its addressee, session {session.name!r}, ended before it claimed it: closed, or its lease ran out"
        for request_id in orphaned:
            handoff = self.handoffs[request_id]
            self.unpark(handoff)
            self.pool.counters.blocks_reclaimed += self.pool.allocator.release_holder(handoff.holder)
            self.pool.counters.handoffs_orphaned += 1
            self.remember_refusal(request_id, why, "after it was parked")
