"""Direct handoffs as a client sees them: the addressed handoff it sends, the inbox it receives on, its claims.

The sealed datagram the pool sends to an inbox, and why a consumer may read the blocks before the pool answers
its claim, are in :mod:`kvpool.inbox`. Here is the bookkeeping around it: deliveries received before their claim,
request ids already claimed through the pool (so that a late copy is dropped), and the pipelined claims whose
answers a later call (or :meth:`DirectHandoffs.confirm`) reads.
"""

from __future__ import annotations

import json
import logging
import operator
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvpool.channel import FastConnection, PipelinedRefusal, decode
from kvpool.errors import (
    ArenaClosed,
    InvalidRequest,
    KvpoolError,
    PoolRestarted,
    PoolUnavailable,
    Unauthorized,
    UnknownSession,
    error_for,
    raise_for,
)
from kvpool.inbox import Delivery, Inbox
from kvpool.protocol import ClaimRequest, HandoffResponse, claim_json, handoff_json
from kvpool.routes import ACCEPT, CLAIM, HANDOFF, Route
from kvpool.session import Session
from kvpool.transport import Transport

log = logging.getLogger(__name__)

T = TypeVar("T")
A = TypeVar("A")


#: how long the pool holds a directly delivered claim (accept) for its handoff to be parked; it is always
#: parked already, since the pool delivers the ids only once it parked the handoff
ACCEPT_WAIT_S = 10.0
#: request ids claimed through the pool remembered, so that a late direct delivery of one is dropped
CLAIMED_KEPT = 4096
#: errors about the session itself, not about one claim: the claimer's refs are then gone with the session
SESSION_ERRORS = (ArenaClosed, PoolRestarted, PoolUnavailable, Unauthorized, UnknownSession)


@dataclass(slots=True)
class Handoff:
    """One ``PoolClient.handoff`` call: a client that carries some handoffs another way (a slab's) takes it whole."""

    request_id: str
    block_ids: Sequence[int] | Any
    num_tokens: int
    meta: dict[str, Any] | None = None
    ttl_s: float | None = None
    to: str | None = None
    keep: bool = False
    sealed: bool = False


def granted(answers: Sequence[Any], convert: Callable[[Any], T]) -> list[T | None]:
    """The answers to calls sent in one write, converted; ``None`` for each the pool refused. An error about the
    session itself is raised, after every answer was read: the session's refs are then the pool's to release,
    while a call refused alone must not lose what was granted beside it."""
    out: list[T | None] = []
    for answer in answers:
        if isinstance(answer, SESSION_ERRORS):
            raise answer
        out.append(None if isinstance(answer, KvpoolError) else convert(answer))
    return out


class Claim:
    """A claimed handoff: its block ids packed (``ids``, fenced int64, as they came off the wire) and as a list
    (``block_ids``, built on first use, so that a caller building a block table from ``ids`` never pays for it).

    ``direct`` is True when the ids were delivered to this client's inbox; the pool's answer to the claim is
    then still on its way (see :meth:`kvpool.client.PoolClient.confirm`). ``parked_by`` is the name of the session
    that parked the handoff, as the pool knew it: what a consumer checks before it trusts the blocks (from the pool's
    answer, or the pool's sealed delivery to an inbox; None for one that came slab to slab).
    """

    __slots__ = ("_list", "direct", "ids", "meta", "num_tokens", "parked_by", "request_id")

    def __init__(
        self,
        request_id: str,
        num_tokens: int,
        meta: dict[str, Any],
        ids: array,
        block_ids: list[int] | None = None,
        direct: bool = False,
        parked_by: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.parked_by = parked_by  # the parking session's name, as the pool says (None: not from the pool)
        self.num_tokens = num_tokens
        self.meta = meta
        self.ids = ids
        self._list = block_ids
        self.direct = direct

    @property
    def block_ids(self) -> list[int]:
        if self._list is None:
            self._list = self.ids.tolist()
        return self._list

    def __repr__(self) -> str:
        return (
            f"Claim(request_id={self.request_id!r}, num_tokens={self.num_tokens}, blocks={len(self.ids)}, "
            f"direct={self.direct})"
        )


def refused_error(refused: list[tuple[str, int, bytes]]) -> KvpoolError:
    """The error for the direct claims the pool refused; ``refused`` on it names them."""
    label, status, body = refused[0]
    exc = error_for(status, body)
    more = f" (and of {len(refused) - 1} more)" if len(refused) > 1 else ""
    err = type(exc)(
        f"the pool refused the claim of request {label!r}{more}, whose ids were delivered to your inbox: {exc}"
    )
    err.refused = tuple(r[0] for r in refused)
    return err


class DirectHandoffs:
    """One client's direct path. ``inbox`` is None until the session opened one (then claims may come direct)."""

    def __init__(self, transport: Transport, session: Session, spin_s: float) -> None:
        self.transport = transport
        self.session = session
        self.spin_s = spin_s
        self.inbox: Inbox | None = None
        self.lock = threading.RLock()
        self.delivered: OrderedDict[str, Delivery] = OrderedDict()
        self.claimed: OrderedDict[str, None] = OrderedDict()

    def open_inbox(self, path: str, key: bytes, mode: int) -> None:
        self.delivered.clear()
        self.claimed.clear()
        try:
            self.inbox = Inbox(path, self.session.epoch, key, mode)
        except OSError as exc:  # the pool's directory is not writable from here: handoffs come through the pool
            log.warning("no inbox at %s (%s): addressed handoffs will come through the pool", path, exc)

    def close_inbox(self) -> None:
        if self.inbox is not None:
            self.inbox.close()
            self.inbox = None

    def close(self) -> None:
        self.close_inbox()

    def guard(self, fn: Callable[[], T]) -> T:
        """Run a call of this session; a refusal of one of its pipelined claims, read on the way, is raised."""
        try:
            return self.session.guard(fn)
        except PipelinedRefusal as exc:
            raise refused_error(exc.refused) from None

    def send(
        self,
        request_id: str,
        block_ids: Sequence[int] | Any,
        num_tokens: int,
        meta: dict[str, Any],
        ttl_s: float | None,
        to: str,
    ) -> HandoffResponse | None:
        """An addressed handoff with its ids attached packed; the pool delivers them to the addressee's inbox.
        None where that path does not apply (no fast channel, ids that do not pack).

        This is the direct path's critical path, so the request is written by hand (:func:`handoff_json`) and goes
        unvalidated here: a pydantic model would cost more than the rest of the path. The pool validates it.
        """
        ids = self.transport.attach(HANDOFF, block_ids)
        if ids is None:
            return None
        try:
            extra = json.dumps(meta, separators=(",", ":")).encode()
            head = handoff_json(self.session.session_id, request_id, operator.index(num_tokens), extra, ttl_s, to)
        except (TypeError, ValueError) as exc:
            why = f"{exc} (meta must be a JSON object, num_tokens an integer at least 0)"
            raise InvalidRequest(f"cannot send this handoff: {why}") from None
        call = self.transport.call
        sent: HandoffResponse = self.guard(lambda: call(HANDOFF, head, ids=ids))[0]
        return sent

    # -- the consumer's side ----------------------------------------------------------------------------

    def claim_any(self, timeout_s: float, from_pool: Callable[[str | None, float], Claim]) -> Claim:
        """The oldest delivered handoff, else (after ``spin_s``) whatever the pool hands this session."""
        start = time.perf_counter()
        with self.lock:
            got = self._delivery(None, min(self.spin_s, timeout_s))
        if got is not None:
            self._pipeline(ACCEPT, got.request_id, ACCEPT_WAIT_S)
            return Claim(got.request_id, got.num_tokens, got.meta, got.ids, direct=True, parked_by=got.parked_by)
        return from_pool(None, max(0.0, timeout_s - (time.perf_counter() - start)))

    def claim_expected(self, request_id: str, timeout_s: float) -> Claim:
        """Put the claim in at the pool first, then watch the inbox: the ids from the producer or the pool's answer,
        whichever comes first, ends the wait."""
        with self.lock:
            got = self.delivered.pop(request_id, None)
            if got is None:
                conn = self._pipeline(CLAIM, request_id, timeout_s)
                got = self._delivery(request_id, min(self.spin_s, timeout_s))
                if got is None:  # nothing delivered: the pool's answer to the claim has the ids
                    _, status, body = self.guard(lambda: self.transport.exchange(lambda _: conn.take()))
                    if status != 200:
                        raise_for(status, body)
                    return self.claimed_in_pool(*decode(CLAIM.response, body))
                return Claim(request_id, got.num_tokens, got.meta, got.ids, direct=True, parked_by=got.parked_by)
        self._pipeline(ACCEPT, request_id, ACCEPT_WAIT_S)
        return Claim(request_id, got.num_tokens, got.meta, got.ids, direct=True, parked_by=got.parked_by)

    def claimed_in_pool(self, resp: Any, ids: array | None) -> Claim:
        """A claim the pool answered; a direct copy of it that arrives later is dropped."""
        if self.inbox is not None:
            with self.lock:
                self.delivered.pop(resp.request_id, None)
                self.claimed[resp.request_id] = None
                while len(self.claimed) > CLAIMED_KEPT:
                    self.claimed.popitem(last=False)
        packed = ids if ids is not None else array("q", resp.block_ids)
        return Claim(resp.request_id, resp.num_tokens, resp.meta, packed, resp.block_ids, parked_by=resp.parked_by)

    def claim_many_in_pool(self, reqs: list[ClaimRequest], wait_s: float) -> list[Claim | None]:
        """Claims answered by the pool, all sent in one write; ``None`` where it refused one (see :func:`granted`)."""
        answers = self.guard(lambda: self.transport.call_many(CLAIM, reqs, wait_s))
        return granted(answers, lambda answer: self.claimed_in_pool(*answer))

    @staticmethod
    def one_by_one(items: Sequence[A], call: Callable[[A], T]) -> list[T | None]:
        """``call`` of each item in turn, ``None`` for each the pool refused; an error about the session raises."""
        out: list[T | None] = []
        for item in items:
            try:
                out.append(call(item))
            except SESSION_ERRORS:
                raise
            except KvpoolError:
                out.append(None)
        return out

    def confirm(self) -> None:
        """Wait for the pool's answers to this thread's direct claims; raise if it refused one."""
        if self.transport.pending() is not None:
            self.guard(lambda: self.transport.exchange(lambda conn: conn.settle()))

    def _delivery(self, request_id: str | None, spin_s: float) -> Delivery | None:
        """A delivered handoff for this claim, from those already received or the inbox, spinning ``spin_s``."""
        assert self.inbox is not None
        until = time.perf_counter() + spin_s
        while True:
            if request_id is None:
                if self.delivered:
                    return self.delivered.popitem(last=False)[1]
            elif request_id in self.delivered:
                return self.delivered.pop(request_id)
            got = self.inbox.receive(until)
            if got is None:
                return None
            if self.claimed.pop(got.request_id, 0) is None:
                continue  # already claimed through the pool: this copy came late
            self.delivered[got.request_id] = got

    def _pipeline(self, route: Route, request_id: str, timeout_s: float) -> FastConnection:
        """Send a claim (or an accept) of ``request_id`` without waiting for its answer; earlier answers first."""
        body = claim_json(self.session.session_id, request_id, timeout_s)

        op = route.fast
        assert op is not None

        def send(conn: FastConnection) -> FastConnection:
            conn.send(op, body, request_id, timeout_s)
            return conn

        return self.guard(lambda: self.transport.exchange(send))
