"""What an engine only tells the pool (commits, parks, releases), batched on a thread of its own.

None of these answers anything the scheduler waits for, so they leave its thread at once and go in at most three
calls a batch; a refusal is logged, and a lost pool is reported to the engine's books (``lose``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.errors import KvpoolError, PoolUnavailable, UnknownSession
from kvpool.integrations.vllm.batcher import Batcher
from kvpool.integrations.vllm.poolcalls import ResidentPool, Write

log = logging.getLogger("vllm.kvpool")

#: what tells the engine that the pool no longer answers for its session: its blocks may be another's from then on
LOST = (PoolUnavailable, UnknownSession)


class PoolWrites:
    def __init__(self, pool: ResidentPool, device: int | None, lose: Callable[[Exception], None]) -> None:
        self.pool = pool
        self.device = device
        self._lose = lose
        self._lane: Batcher[Write, None] = Batcher("kvpool-writes", self._write_many, lambda exc: None)

    def commit(self, fenced: list[int], tokens: list[int], start: int, salt: str | None) -> None:
        self._lane.submit(Write("commit", fenced, tokens, start, salt=salt))

    def park(self, key: str, fenced: list[int], tokens: list[int], meta: dict[str, Any], salt: str | None) -> None:
        self._lane.submit(Write("park", fenced, tokens, key=key, meta=meta, salt=salt))

    def release(self, ids: Sequence[int]) -> None:
        self._lane.submit(Write("free", list(ids)))

    def drain(self) -> None:
        self._lane.drain()

    def close(self) -> None:
        self._lane.close()

    def _write_many(self, writes: list[Write]) -> list[None]:
        """What the engine told the pool since the last call, in three calls at most: every commit (one write),
        then every park (one write), then every release. The order within a kind stays; across kinds it can change
        only so, because a commit or a park names blocks the engine held when it was queued, which a release queued
        after it in the same batch cannot have taken: vLLM frees a request's blocks after the connector heard of
        its end, and a release queued before a commit names blocks no running request uses."""
        commits = [w for w in writes if w.kind == "commit"]
        parks = [w for w in writes if w.kind == "park"]
        frees = [i for w in writes if w.kind == "free" for i in w.ids]
        if commits:
            calls = [(w.ids, w.tokens, w.start) for w in commits]
            self.quietly("commits", functools.partial(self.pool.commit_many, salts=[w.salt for w in commits]), calls)
        if parks:
            self._park_many(parks)
        if frees:
            self.quietly("release", self.pool.free, frees)
        return [None] * len(writes)

    def quietly(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except LOST as exc:
            self._lose(exc)
        except KvpoolError as exc:
            log.warning("kvpool: %s refused: %s", what, exc)
        return None

    def _park_many(self, parks: list[Write]) -> None:
        """Every park in one write. A park the pool refuses (one of its blocks was a duplicate of a block the
        index held, so not committed, and a kept handoff shares committed blocks only) is parked instead with the
        index's blocks for its tokens: a lookup takes refs for the handoff to move."""
        handoffs = [(w.key, w.ids, len(w.tokens), w.meta) for w in parks]
        park = functools.partial(self.pool.handoff_many, keep=True, sealed=True)
        answers = self.quietly("parks", park, handoffs)
        refused = [w for w, a in zip(parks, answers or [None] * len(parks), strict=True) if a is None]
        if not refused:
            return
        look = functools.partial(self.pool.lookup_many, salts=[w.salt for w in refused])
        hits = self.quietly("lookups for parks", look, [w.tokens for w in refused], self.device) or []
        moved = [(w.key, list(h.block_ids), h.num_tokens, w.meta) for w, h in zip(refused, hits, strict=False)
                 if h.block_ids]  # fmt: skip
        answers = self.quietly("parks", functools.partial(self.pool.handoff_many, sealed=True), moved) if moved else []
        unused = [i for m, a in zip(moved, answers or [None] * len(moved), strict=True) if a is None for i in m[1]]
        if unused:
            self.quietly("release", self.pool.free, unused)
