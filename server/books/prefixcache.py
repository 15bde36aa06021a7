"""The prefix cache's calls on the pool's books: commits that index full blocks under their tokens' hash chain, and
lookups that take refs on the longest cached prefix (from the host tier or other arenas too, where the pool has them).

The index, the hashers and the refs stay the pool's (:class:`~kvpool.server.books.pool.Pool`); it owns one
:class:`PrefixCache` and hands these calls on, as it does the parking's.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from kvpool.errors import InvalidRequest
from kvpool.server.books.records import CommitResult, LookupResult

#: the :class:`kvpool.server.books.pool.Pool` that owns this part (it imports this module, so not the other way)
Pool = Any


class PrefixCache:
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    def commit(
        self,
        session_id: str,
        block_ids: Sequence[int],
        token_ids: Sequence[int],
        salt: str | None = None,
        start: int = 0,
        release: bool = False,
    ) -> CommitResult:
        """Index the full blocks of ``token_ids``, held in ``block_ids`` (block i holds tokens i*bs..), under
        ``salt``'s chains: only lookups with the same salt find them.

        ``start``: the chain's first blocks are in the index already (a prefix the caller looked up), and
        ``block_ids`` hold block ``start`` onwards; the pool checks that prefix instead of taking refs on it, and
        commits nothing if part of it was evicted since (a chain cannot go on past a gap). ``release``: then drop
        the caller's refs on ``block_ids``, as :meth:`free` does. A caller that saves a prompt after a hit thus
        makes one call where it made three (lookup, commit, free).
        """
        holder = self.pool.session(session_id).holder
        self.pool.gives_up(session_id)
        num_full = len(token_ids) // self.pool.layout.block_size
        if start > num_full:
            raise InvalidRequest(f"start {start} is past the {num_full} full blocks of token_ids")
        if len(block_ids) < num_full - start:
            raise InvalidRequest(
                f"token_ids fill {num_full} blocks of {self.pool.layout.block_size} tokens, {num_full - start} of them "
                f"from block {start} on, but only {len(block_ids)} block ids were given"
            )
        if len(set(block_ids)) != len(block_ids):
            raise InvalidRequest("block_ids lists a block twice: each block holds one span of tokens")
        held = self.pool.unfence(block_ids, holder)
        result = self.record(held[: num_full - start], token_ids, salt, start, num_full)
        if release:
            self.pool.allocator.drop(holder, held)
            self.pool.counters.free_blocks += len(held)
        return result

    def record(self, blocks: list[int], token_ids: Sequence[int], salt: str | None, start: int,
               num_full: int, count: bool = True) -> CommitResult:  # fmt: skip
        """Index ``blocks`` under the chain of ``token_ids`` from block ``start`` on (a commit's, or a copy's from
        another arena, uncounted)."""
        if not blocks:
            return CommitResult(committed=0, duplicates=0, num_blocks=num_full)
        arena = 0
        if len(self.pool.arena_sizes) > 1:
            arenas = {self.pool.allocator.arena_of[b] for b in blocks}
            if len(arenas) > 1:
                raise InvalidRequest("a committed prefix must sit in one arena: these blocks span several devices")
            arena = arenas.pop()
        chain = self.pool.hashers[arena].blocks(token_ids, salt)
        parent, missing = self.pool.index.tail(itertools.islice(chain, start)) if start else (None, 0)
        if missing:
            return CommitResult(committed=0, duplicates=0, num_blocks=num_full, missing=missing)
        new = self.pool.index.plan(chain, blocks, parent)
        self.pool.allocator.mark_committed([node.block for node in new])
        self.pool.index.apply(new)
        if not count:
            return CommitResult(committed=len(new), duplicates=len(blocks) - len(new), num_blocks=num_full)
        c = self.pool.counters
        c.commit_requests += 1
        c.committed_blocks += len(new)
        c.duplicate_blocks += len(blocks) - len(new)
        return CommitResult(committed=len(new), duplicates=len(blocks) - len(new), num_blocks=num_full)

    def lookup(
        self, session_id: str, token_ids: Sequence[int], arena: int = 0, salt: str | None = None
    ) -> LookupResult:
        """The longest cached prefix of ``token_ids`` in ``arena`` committed with ``salt``, with a ref taken on each
        block for the session."""
        return self.lookup_many(session_id, [(token_ids, salt)], arena)[0]

    def lookup_many(
        self, session_id: str, lookups: Sequence[tuple[Sequence[int], str | None]], arena: int = 0
    ) -> list[LookupResult]:
        """:meth:`lookup` of each prompt in order. Blocks that other arenas copy over for all of them go in one copy
        per pair of arenas once every prompt was looked up (a burst's prefixes in one large copy, which runs near
        the link's speed, instead of one small copy each); a prompt that finds blocks an earlier one had copied
        over in the same call hits them too. Where a copy fails, the prompts that named its blocks stop before
        them."""
        holder = self.pool.session(session_id).holder
        if self.pool.peers is None:
            return [self._hit(self._lookup(holder, t, arena, salt), t) for t, salt in lookups]
        try:
            found = [self._lookup(holder, t, arena, salt) for t, salt in lookups]
        finally:
            failed = self.pool.peers.finish()
        if failed:
            for i, ids in enumerate(found):
                cut = next((k for k, block in enumerate(ids) if block in failed), len(ids))
                self.pool.allocator.drop(holder, ids[cut:])
                found[i] = ids[:cut]
        return [self._hit(ids, t) for ids, (t, _) in zip(found, lookups, strict=True)]

    def _lookup(self, holder: str, token_ids: Sequence[int], arena: int, salt: str | None) -> list[int]:
        if not 0 <= arena < len(self.pool.hashers):
            raise InvalidRequest(f"no arena {arena}: the pool has {len(self.pool.hashers)}")
        blocks = self.pool.hashers[arena].blocks(token_ids, salt)
        if self.pool.host_tier is not None:
            ids, _ = self.pool.host_tier.lookup(holder, blocks, arena)
        else:
            ids = self.pool.index.match(blocks)
            self.pool.allocator.acquire(holder, ids)
        if self.pool.peers is not None and len(ids) < len(token_ids) // self.pool.layout.block_size:
            ids = ids + self.pool.peers.extend(holder, token_ids, salt, arena, ids)
        return ids

    def _hit(self, ids: list[int], token_ids: Sequence[int]) -> LookupResult:
        c = self.pool.counters
        c.lookup_requests += 1
        c.lookup_blocks += len(token_ids) // self.pool.layout.block_size
        c.hit_blocks += len(ids)
        return LookupResult(self.pool.allocator.fenced(ids), len(ids) * self.pool.layout.block_size)
