"""What :class:`kvpool.client.PoolClient` does with a slab: one place that decides, per call, whether the slab
serves it locally or the pool does, so that a client without a slab pays one attribute check per call."""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool.errors import HandoffNotFound, InvalidRequest, KvpoolError
from kvpool.handoffs import Claim
from kvpool.protocol import HandoffResponse
from kvpool.slab import Slab, SlabConfig
from kvpool.slabbox import SlabBox
from kvpool.slabsend import SlabSender
from kvpool.transport import Transport

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how often a claim waiting on the lease box also asks the pool (for a handoff its producer parked there)
POLL_S = 0.02
#: where stores reach other processes in program order, which the lease table's one-writer fields rely on
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


class Slabs:
    def __init__(self, transport: Transport, config: SlabConfig | None, spin_s: float) -> None:
        self.transport = transport
        self.config = config
        self.spin_s = spin_s
        self.slab: Slab | None = None
        self.sender: SlabSender | None = None
        self.box: SlabBox | None = None

    def open(self, session_id: str, epoch: str, mode: int) -> None:
        """Take a region of the pool's lease table for this session; without one (a pool without ``--leases``,
        all regions taken, a table this process may not map) the client works through the pool."""
        if self.config is None:
            return
        if platform.machine().lower() not in X86_64:
            log.warning("no slab on %s: the lease table relies on x86-64 store order", platform.machine())
            return
        try:
            self.slab = Slab.open(self.transport, session_id, epoch, self.config)
        except (KvpoolError, OSError) as exc:
            log.warning("no slab for this session, alloc and free go through the pool: %s", exc)
            return
        self.sender, self.box = SlabSender(self.slab), SlabBox(self.slab, mode)

    def close(self) -> None:
        for side in (self.sender, self.box):
            if side is not None:
                side.close()
        if self.slab is not None:
            self.slab.close()
        self.slab = self.sender = self.box = None

    def answer_want(self) -> None:
        if self.slab is not None:
            self.slab.answer_want()

    @property
    def receiving(self) -> bool:
        return self.box is not None and self.box.sock is not None

    def alloc(self, n: int) -> list[int] | None:
        return self.slab.alloc(n) if self.slab is not None else None

    def free(self, ids: Sequence[int] | Any, in_pool: Callable[[Sequence[int] | Any], int]) -> int:
        """Free ``ids``, into the slab what is the slab's and through ``in_pool`` the rest."""
        if self.slab is None or not len(ids):
            return in_pool(ids)

        def rest(others: list[int]) -> int:
            self.settle()
            return in_pool(others)

        return self.slab.free(ids, rest)

    def through_pool(self, ids: Sequence[int] | Any, call: Callable[[], T]) -> T:
        """A call that gives ``ids`` up at the pool (commit, a handoff through it): the slab's blocks among them
        leave the slab once the pool took them, and blocks this session was handed are settled first."""
        if self.slab is None:
            return call()
        self.settle()
        return self.slab.leave(ids, call)

    def settle(self) -> None:
        if self.box is not None:
            self.box.settle()

    def handoff(
        self, request_id: str, ids: Sequence[int] | Any, num_tokens: int, meta: dict[str, Any] | None, to: str
    ) -> HandoffResponse | None:
        if self.sender is None:
            return None
        try:
            extra = json.dumps(meta, separators=(",", ":")).encode() if meta else b""
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"cannot send this handoff: meta must be a JSON object ({exc})") from None
        n = self.sender.handoff(request_id, ids, int(num_tokens), extra, to)
        if n is None:
            return None
        return _sent(request_id, n)

    def claim(self, request_id: str | None, timeout_s: float, from_pool: Callable[[str | None, float], Claim]) -> Claim:
        """A handoff from a slab or, failing that, one parked in the pool, whichever turns up first."""
        assert self.box is not None
        deadline = time.perf_counter() + timeout_s
        got = self.box.receive(request_id, self.spin_s, self.spin_s)
        while got is None:
            try:
                return from_pool(request_id, 0.0)
            except HandoffNotFound:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    raise
            got = self.box.receive(request_id, 0.0, min(POLL_S, remaining))
        return got
