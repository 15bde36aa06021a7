"""A request's state in resident mode, in one record, from its arrival to its release.

Everything the engine keeps for a request (the pool's answer on its way or back, the blocks its hit pinned, what was
installed for it, when the scheduler last asked) lives in one :class:`ResidentRequest`, held in one table (the
:class:`.residency.Residency`'s ``requests``) and dropped there in one place when the request leaves: no part of a
request's state can outlive the rest, and its phase says which parts it may have (:meth:`ResidentRequest.check`).

The lifecycle: ``ARRIVED`` (the pool's answer asked, on its way or back) -> ``ANSWERED`` (the answer taken: its hit
installed and pinned, or none and it computes its prompt) -> ``RUNNING`` (vLLM placed it: its hit blocks count in
vLLM's refs, nothing pinned) -> released (finished, parked or aborted: the record goes, an answer still on its way is
given back when it comes). A preempted request is asked again (``RUNNING`` -> ``ARRIVED``), and vLLM may place a
request it never asked a hit for (prefix caching off: ``ARRIVED`` -> ``RUNNING``).
"""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.integrations.vllm.poolcalls import Hit


class Phase(enum.Enum):
    ARRIVED = "arrived"
    ANSWERED = "answered"
    RUNNING = "running"


#: the phases a request may move to from each (staying is always allowed)
NEXT: dict[Phase, frozenset[Phase]] = {
    Phase.ARRIVED: frozenset({Phase.ANSWERED, Phase.RUNNING}),
    Phase.ANSWERED: frozenset({Phase.RUNNING}),
    Phase.RUNNING: frozenset({Phase.ARRIVED}),
}


@dataclass(slots=True, eq=False)
class ResidentRequest:
    """One request's resident state. The scheduler's thread writes it, but for ``future`` (set by whichever thread
    the request arrived on) and ``answer`` and ``claim_us`` (set by the thread that read the pool's answer)."""

    req_id: str
    phase: Phase = Phase.ARRIVED
    #: the pool's answer (a lookup or a claim), while it is on its way
    future: Future[Hit] | None = None
    #: the answer, once back: put here before the future is done, so that taking it is an attribute read
    answer: Hit | None = None
    #: a claim's round trip (us), kept until its blocks are installed
    claim_us: float | None = None
    #: the held blocks its hit installed while vLLM has not placed it (never changed in place)
    pins: list[int] | None = None
    #: what was installed for it (the engine's blocks of the hit, and the hit), found again if vLLM asks again
    installed: tuple[list[int], Hit] | None = None
    #: its preemptions when its answer was taken: it is asked again only after another preemption
    asked_at: int | None = None
    #: vLLM is to leave it waiting this step, its answer not back yet; and since when it has waited
    later: bool = False
    since: float | None = None
    #: the new blocks its prompt will take, which the slab is refilled for ahead while vLLM has not placed it: 0 until
    #: its answer is back (then its prompt's blocks less its hit); None once placed, or before it arrived
    demand: int | None = None

    def to(self, phase: Phase) -> None:
        """Move to ``phase``; a move the lifecycle does not have is a bug in the books."""
        if phase is not self.phase and phase not in NEXT[self.phase]:
            raise AssertionError(f"request {self.req_id} cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase

    def check(self, held: dict[int, int]) -> None:
        """Assert what its phase allows: only an arrived request waits on the pool or is left waiting, only an
        answered one pins or has something installed, and every block it pins is one the engine holds."""
        rid, phase = self.req_id, self.phase
        if phase is not Phase.ARRIVED:
            assert not self.later, f"request {rid} is {phase.value} but left waiting"
        if phase is Phase.RUNNING:
            assert self.demand is None, f"request {rid} is running but the slab is still refilled for it"
        if phase is not Phase.ANSWERED:
            assert self.pins is None, f"request {rid} is {phase.value} but pins blocks"
            assert self.installed is None, f"request {rid} is {phase.value} but has a hit installed"
        if self.later:
            assert self.since is not None, f"request {rid} is left waiting with no start to its wait"
        missing = [b for b in self.pins or () if b not in held]
        assert not missing, f"request {rid} pins blocks {missing} that the engine does not hold"
