"""``SlabClient``: a :class:`PoolClient` with a reservation slab, and what it does differently.

Each call decides whether the slab serves it locally (alloc and free of uncommitted blocks, a handoff to another slab
session) or the plain client's call does, through the pool. The slab stands on the client: :mod:`kvpool.client` names
no slab, and a plain client never imports this package.

The slab itself is :mod:`kvpool.slab.reservation`; handoffs from it to another slab, :mod:`kvpool.slab.send`;
handoffs to it, :mod:`kvpool.slab.box`.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool.client import PoolClient
from kvpool.errors import HandoffNotFound, InvalidRequest, KvpoolError
from kvpool.handoffs import Claim, Handoff
from kvpool.protocol import CommitResponse, HandoffResponse
from kvpool.slab.box import SlabBox
from kvpool.slab.reservation import Slab, SlabConfig
from kvpool.slab.send import SlabSender

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how often a claim waiting on the slab box also asks the pool (for a handoff its producer parked there)
POLL_S = 0.02
#: where stores reach other processes in program order, which the slab table's one-writer fields rely on
X86_64 = frozenset({"x86_64", "amd64"})
_SENT_FIELDS = frozenset(HandoffResponse.model_fields)


def _sent(request_id: str, num_blocks: int) -> HandoffResponse:
    """The answer to a handoff from slab to slab, built as ``model_construct`` would, in a quarter of its time."""
    sent = object.__new__(HandoffResponse)
    setattr_ = object.__setattr__
    setattr_(sent, "__dict__", {"request_id": request_id, "num_blocks": num_blocks, "inbox": None, "slab": True})
    setattr_(sent, "__pydantic_fields_set__", _SENT_FIELDS)
    setattr_(sent, "__pydantic_extra__", None)
    setattr_(sent, "__pydantic_private__", None)
    return sent


class SlabClient(PoolClient):
    """A session with the pool that keeps a reservation slab, where the pool serves them (``kvpool serve --slabs``):
    alloc, free and handoffs to other slab sessions then skip the round trip.

    ``slab``: a :class:`SlabConfig`; True or None: ``KVPOOL_SLAB_BLOCKS`` (and ``_LOW``, ``_HIGH``, ``_RING``) where
    set, else the defaults; False: none. ``slab`` is None where the pool gave none (a pool without ``--slabs``, every
    region taken, a table this process may not map, a CPU without x86-64's store order): then every call goes through
    the pool. The other arguments are :class:`PoolClient`'s.
    """

    def __init__(self, *args: Any, slab: SlabConfig | bool | None = None, **kwargs: Any) -> None:
        asked = slab if isinstance(slab, SlabConfig) else SlabConfig.from_env() or SlabConfig()
        self.slab_config: SlabConfig | None = None if slab is False else asked
        self.slab: Slab | None = None
        self.slab_sender: SlabSender | None = None
        self.slab_box: SlabBox | None = None
        super().__init__(*args, **kwargs)

    # -- the session ------------------------------------------------------------------------------------

    def _open_session(self) -> None:
        self._close_slab()  # a reconnect's: the old session's region is the pool's again
        super()._open_session()
        self._open_slab()

    def _open_slab(self) -> None:
        """Take a region of the pool's slab table for this session; without one the client works through the pool."""
        if self.slab_config is None:
            return
        if platform.machine().lower() not in X86_64:
            log.warning("no slab on %s: the slab table relies on x86-64 store order", platform.machine())
            return
        session = self.session
        try:
            slab = Slab.open(self.transport, session.session_id, session.epoch, self.slab_config)
        except (KvpoolError, OSError) as exc:
            log.warning("no slab for this session, alloc and free go through the pool: %s", exc)
            return
        self.slab = slab
        session.on_beat = slab.answer_want
        if self.slab_config.handoffs:
            self.slab_sender = SlabSender(slab)
            self.slab_box = SlabBox(slab, self.transport.fast_mode())

    def _close_slab(self) -> None:
        self.session.on_beat = None
        for side in (self.slab_sender, self.slab_box):
            if side is not None:
                side.close()
        if self.slab is not None:
            self.slab.close()
        self.slab = self.slab_sender = self.slab_box = None

    def close(self) -> None:
        if not self._closed:
            self._close_slab()
        super().close()

    # -- blocks -----------------------------------------------------------------------------------------

    def alloc(self, num_blocks: int, device: int | None = None) -> list[int]:
        slab = self.slab
        if slab is not None and device in (None, slab.config.device) and self.session.lost is None:
            got = slab.alloc(num_blocks)
            if got is not None:
                return got
        return super().alloc(num_blocks, device)

    def free(self, block_ids: Sequence[int]) -> int:
        """Free ``ids``: into the slab what is the slab's, through the pool the rest (blocks this session was handed
        settled first)."""
        in_pool: Callable[[Sequence[int]], int] = super().free
        if self.slab is None or not len(block_ids):
            return in_pool(block_ids)

        def rest(others: list[int]) -> int:
            self._settle()
            return in_pool(others)

        return self.slab.free(block_ids, rest)

    def commit(
        self, block_ids: Sequence[int], token_ids: Sequence[int], salt: str | None = None, start: int = 0,
        release: bool = False,
    ) -> CommitResponse:  # fmt: skip
        commit = super().commit
        return self._through_pool(block_ids, lambda: commit(block_ids, token_ids, salt, start, release))

    def commit_many(
        self, commits: Sequence[tuple[Sequence[int], Sequence[int], int]], release: bool = False,
        salts: Sequence[str | None] | None = None,
    ) -> list[CommitResponse | None]:  # fmt: skip
        commit_many = super().commit_many
        if self.slab is None:
            return commit_many(commits, release, salts)
        self._settle()  # all in one write; the slab's blocks of each commit the pool took leave the slab
        return self.slab.leave_many([c[0] for c in commits], lambda: commit_many(commits, release, salts))

    # -- handoffs ---------------------------------------------------------------------------------------

    def _handoff(self, h: Handoff) -> HandoffResponse:
        handoff = super()._handoff
        if h.keep:  # the blocks stay this session's: nothing leaves the slab, nothing goes slab to slab
            return handoff(h)
        # to itself: through the pool, where the refs wait for its claim; sealed: the pool keeps what a slab box
        # cannot, who parked it and that only its id takes it
        if h.to is not None and h.to != self.name and not h.sealed and self.slab_sender is not None:
            sent = self._send(h.request_id, h.block_ids, h.num_tokens, h.meta, h.to)
            if sent is not None:
                return sent
        return self._through_pool(h.block_ids, lambda: handoff(h))

    def handoff_many(
        self,
        handoffs: Sequence[tuple[str, Sequence[int], int, dict[str, Any] | None]],
        ttl_s: float | None = None,
        keep: bool = False,
        sealed: bool = False,
    ) -> list[HandoffResponse | None]:
        if self.slab is None or keep:  # kept blocks stay in the slab: all in one write
            return super().handoff_many(handoffs, ttl_s, keep, sealed)
        # a slab's blocks leave it handoff by handoff
        return self.direct.one_by_one(handoffs, lambda h: self._handoff(Handoff(*h, ttl_s, sealed=sealed)))

    def _send(
        self, request_id: str, ids: Sequence[int] | Any, num_tokens: int, meta: dict[str, Any] | None, to: str
    ) -> HandoffResponse | None:
        """From the slab straight to the slab of the session called ``to``; None where that path does not apply."""
        assert self.slab_sender is not None
        try:
            extra = json.dumps(meta, separators=(",", ":")).encode() if meta else b""
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"cannot send this handoff: meta must be a JSON object ({exc})") from None
        n = self.slab_sender.send(request_id, ids, int(num_tokens), extra, to)
        return None if n is None else _sent(request_id, n)

    def claim(self, request_id: str | None = None, timeout_s: float = 30.0) -> Claim:
        """A handoff from a slab or, failing that, one parked in the pool, whichever turns up first."""
        from_pool: Callable[[str | None, float], Claim] = super().claim
        box = self.slab_box
        if box is None or box.sock is None:
            return from_pool(request_id, timeout_s)
        spin_s = self.direct.spin_s
        deadline = time.perf_counter() + timeout_s
        got = box.receive(request_id, spin_s, spin_s)
        while got is None:
            try:
                return from_pool(request_id, 0.0)
            except HandoffNotFound:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:  # the pool's answer says "within 0s": each look at it waited none
                    wanted = "parked for you" if request_id is None else repr(request_id)
                    raise HandoffNotFound(
                        f"no handoff {wanted} within {timeout_s:g}s (from a slab or through the pool)"
                    ) from None
            got = box.receive(request_id, 0.0, min(POLL_S, remaining))
        return got

    def claim_many(self, request_ids: Sequence[str], timeout_s: float = 0.0) -> list[Claim | None]:
        if self.slab_box is None or self.slab_box.sock is None:
            return super().claim_many(request_ids, timeout_s)
        return self.direct.one_by_one(request_ids, lambda r: self.claim(r, timeout_s))

    # -- settling ---------------------------------------------------------------------------------------

    def _through_pool(self, ids: Sequence[int] | Any, call: Callable[[], T]) -> T:
        """A call that gives ``ids`` up at the pool (commit, a handoff through it): the slab's blocks among them
        leave the slab once the pool took them, and blocks this session was handed are settled first."""
        if self.slab is None:
            return call()
        self._settle()
        return self.slab.leave(ids, call)

    def _settle(self) -> None:
        if self.slab_box is not None:
            self.slab_box.settle()
