"""What an engine's residency did, for its logs and benchmarks: counts, and the latest handovers' times."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class ResidentCounters:
    """What an engine's residency did, for its logs and the benchmark: nothing here counts a copy, since resident
    mode makes none (``copied_blocks`` stays 0; the copy-mode connector counts its own)."""

    installed_blocks: int = 0  # blocks a lookup or claim put into vLLM's prefix cache
    installed_requests: int = 0
    committed_blocks: int = 0  # blocks this engine computed and gave to the pool's prefix index
    parked_requests: int = 0
    left_to_pool: int = 0
    left_to_slab: int = 0
    refills: int = 0
    foreign_handoffs: int = 0  # claims of prefills parked in another GPU's arena: released, the prompt computed
    copied_blocks: int = 0


@dataclass
class Handovers:
    """How long a decode engine's handovers took (microseconds, the latest ones).

    ``taken_in_us`` is the handover itself: from the scheduler taking the request in to its blocks being usable
    (its hit handed to vLLM), with any wait for the claim's answer. ``claim_us`` runs from the request's arrival in
    the engine to the pool's answer; it overlaps the request's wait in the engine's queue, and it waits in the pool
    if the prefill engine has not parked the request yet."""

    claim_us: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    taken_in_us: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    #: each wait of the scheduler for an answer (lookup or claim) not back when it would take the request in: a
    #: step's brief wait, or a wait past it
    wait_us: deque[float] = field(default_factory=lambda: deque(maxlen=4096))

    def summary(self) -> dict[str, int]:
        out = {}
        if self.wait_us:
            out["answer_waits"] = len(self.wait_us)
            out["answer_wait_p50_us"] = int(statistics.median(self.wait_us))
            out["answer_wait_max_us"] = int(max(self.wait_us))
        if self.taken_in_us:
            out["handovers"] = len(self.taken_in_us)
            out["handover_p50_us"] = int(statistics.median(self.taken_in_us))
            out["handover_p99_us"] = int(sorted(self.taken_in_us)[int(0.99 * (len(self.taken_in_us) - 1))])
        if self.claim_us:
            out["handover_claim_from_arrival_p50_us"] = int(statistics.median(self.claim_us))
        return out
