"""Chunked, batched prefill over a prefix cache: the scheduling both the prefill worker and the monolithic one use.

Requests wait in arrival order. Admitting one looks its prompt up in the prefix cache (the pool's, or a private
one) and allocates blocks for the rest; then each :meth:`PrefillBatcher.step` packs new tokens of the admitted
requests, oldest first, into one forward of at most ``token_budget`` tokens. A prompt longer than the budget is
cut into chunks over several steps, so requests behind it are not stalled for its whole length.

A request whose first block is being computed for another admitted request waits until that one has committed:
computing the same system prompt twice in one batch would waste the forward, and a step later it is a hit.
Both workers run this same code, so the comparison between them measures where the cache lives, not how it is
used.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.errors import PoolExhausted
from kvpool.workers.model import KVCaches, LlamaModel, PrefillPiece
from kvpool.workers.request import GenerationRequest
from kvpool.workers.sequence import blocks_needed, greedy


class Hit(Protocol):
    @property
    def block_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...


class PrefixBlocks(Protocol):
    """A block source with a prefix cache: :class:`kvpool.devices.DeviceSession` or a private one."""

    def alloc(self, num_blocks: int) -> list[int]: ...

    def free(self, block_ids: Sequence[int]) -> object: ...

    def lookup(self, token_ids: Sequence[int], salt: str | None = None) -> Hit: ...

    def commit(self, block_ids: Sequence[int], token_ids: Sequence[int], salt: str | None = None) -> object: ...


@dataclass
class Prefilling:
    """An admitted request: ``done`` of its prompt's tokens have K/V in ``block_ids`` (the hit, then chunks)."""

    request: GenerationRequest
    arrived_at: float
    block_ids: list[int]
    hit_tokens: int
    done: int
    first_token: int | None = None


@dataclass
class Waiting:
    request: GenerationRequest
    arrived_at: float


class PrefillBatcher:
    """The queue of requests to prefill and the steps that compute them; see the module's docstring."""

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: KVCaches,
        blocks: PrefixBlocks,
        block_size: int,
        token_budget: int = 4096,
        max_running: int = 64,
        wait_for_prefix: bool = True,
    ) -> None:
        if token_budget < 1:
            raise ValueError(f"token_budget must be at least 1, got {token_budget}")
        self.model = model
        self.kv_caches = kv_caches
        self.blocks = blocks
        self.block_size = block_size
        self.token_budget = token_budget
        self.max_running = max_running
        self.wait_for_prefix = wait_for_prefix
        self.waiting: deque[Waiting] = deque()
        self.running: list[Prefilling] = []

    def add(self, request: GenerationRequest, arrived_at: float | None = None) -> None:
        self.waiting.append(Waiting(request, time.time() if arrived_at is None else arrived_at))

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def admit(self, limit: int | None = None) -> int:
        """Admit waiting requests, oldest first, while blocks last; returns how many. Stops at the first
        request the cache cannot hold yet (blocks free up as other requests end) or whose prefix is in flight."""
        admitted = 0
        room = self.max_running - len(self.running)
        if limit is not None:
            room = min(room, limit)
        while self.waiting and admitted < room:
            head = self.waiting[0]
            prompt = head.request.prompt
            if self.wait_for_prefix and self._prefix_in_flight(head.request):
                break
            hit = self.blocks.lookup(prompt[:-1], head.request.salt)
            ids = list(hit.block_ids)
            try:
                ids += self.blocks.alloc(blocks_needed(len(prompt), self.block_size) - len(ids))
            except PoolExhausted:
                if ids:
                    self.blocks.free(ids)
                break
            self.waiting.popleft()
            self.running.append(Prefilling(head.request, head.arrived_at, ids, hit.num_tokens, hit.num_tokens))
            admitted += 1
        return admitted

    def _prefix_in_flight(self, request: GenerationRequest) -> bool:
        """Whether a running request computes this one's first block, under the same salt (else it is no hit)."""
        bs, prompt = self.block_size, request.prompt
        if len(prompt) <= bs:
            return False
        first = list(prompt[:bs])
        return any(
            p.hit_tokens < bs and p.request.salt == request.salt and list(p.request.prompt[:bs]) == first
            for p in self.running
        )

    def step(self) -> list[Prefilling]:
        """One forward over the next chunks of the running requests; the requests whose prompts it finished
        (their ``first_token`` set; the caller commits, hands off or decodes them, then :meth:`release` s)."""
        pieces: list[PrefillPiece] = []
        chunked: list[Prefilling] = []
        budget = self.token_budget
        for p in self.running:
            if budget <= 0:
                break
            n = min(len(p.request.prompt) - p.done, budget)
            pieces.append(PrefillPiece(p.block_ids, p.done, p.request.prompt[p.done : p.done + n]))
            chunked.append(p)
            budget -= n
        if not pieces:
            return []
        logits = self.model.prefill_batch(pieces, self.kv_caches)
        for p, piece in zip(chunked, pieces, strict=True):
            p.done += len(piece.tokens)
        ends = [i for i, p in enumerate(chunked) if p.done == len(p.request.prompt)]
        tokens = greedy(logits[ends]) if ends else []
        finished = [chunked[i] for i in ends]
        for p, token in zip(finished, tokens, strict=True):
            p.first_token = token
        return finished

    def release(self, done: Sequence[Prefilling]) -> None:
        """Take finished requests out of the running set (their blocks are the caller's now)."""
        ids = {id(p) for p in done}
        self.running = [p for p in self.running if id(p) not in ids]

    def fail_all(self) -> list[Prefilling]:
        """Drop every running request, freeing its blocks: what to do when a step failed."""
        dropped, self.running = self.running, []
        for p in dropped:
            self.blocks.free(p.block_ids)
        return dropped
