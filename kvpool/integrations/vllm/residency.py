"""An engine's arena blocks in resident mode: which the engine holds, why, and when they go back to the pool.

In resident mode an engine's KV cache *is* the arena, and its block pool takes block ids from the pool instead of
owning a private range. This module keeps the engine's side of those books, with no vLLM and no torch, so that it
can be reasoned about and tested alone; :mod:`.blockpool` puts it under vLLM's own ``BlockPool``.

The engine holds **exactly one pool ref on every block it has anything to do with**: a block one of its requests
uses (vLLM's own ref count is above 0), or a block a prefix hit or a claim installed for a request that vLLM has not
scheduled yet (*pinned*). Every other arena block is someone else's or the pool's: vLLM's prefix-cache map never
names one, so a hit in this engine never reads a block the pool may have recycled. A block comes to the engine

* from its slab (``take``): allocated, uncommitted, written only by this engine;
* from the pool's prefix index or a parked handoff (``install``): committed, never written again.

and leaves it (``leave``) once vLLM no longer uses it and no request waits on it: an uncommitted block back into the
slab at once (only this engine reuses it, after the steps that wrote it); a committed one back to the pool, whose
LRU then owns it (eviction is the pool's alone and never takes a block any engine holds). A request's full blocks
are committed when it finishes, so its prompt's prefix becomes every engine's. Pool calls that answer something
(lookups, claims) run on one thread, those that only tell the pool (commits, parks, releases) on another, so the
scheduler's thread never waits on a round trip except to refill the slab when it runs dry.

Past 400 lines because the held blocks, the pins and the requests' records are one set of books that the scheduler's
thread changes together and :meth:`Residency.check_requests` checks together; what stands around them has modules of
its own: the lanes (:mod:`.batcher`), the calls' shapes (:mod:`.poolcalls`), the writes (:mod:`.writes`), a request's
record (:mod:`.residentrequest`), peers (:mod:`.remote`) and the counters (:mod:`.residentcounters`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from contextlib import AbstractContextManager
from typing import Any

from kvpool.errors import KvpoolError, PoolExhausted
from kvpool.ids import BLOCK_MASK
from kvpool.integrations.vllm import remote
from kvpool.integrations.vllm.batcher import Batcher
from kvpool.integrations.vllm.poolcalls import NO_HIT, Claim, Hit, ResidentPool
from kvpool.integrations.vllm.residentcounters import Handovers, ResidentCounters
from kvpool.integrations.vllm.residentrequest import Phase, ResidentRequest
from kvpool.integrations.vllm.writes import LOST, PoolWrites

__all__ = ["Hit", "PoolGone", "Residency", "ResidentPool"]

log = logging.getLogger("vllm.kvpool")


class PoolGone(KvpoolError):
    """The pool that owns this engine's KV memory stopped answering for it: the engine must not take new work."""


class Residency:
    """The engine's held blocks, pins and pool calls. All methods but ``prefetch`` run on the scheduler's thread.

    ``first_block`` is where the engine's arena starts in the pool's global numbering: a block's id in vLLM is its
    index in that arena, so block 0 is the arena's first block, which the pool keeps as vLLM's null block.
    """

    def __init__(
        self,
        pool: ResidentPool,
        block_size: int,
        num_blocks: int,
        *,
        first_block: int = 0,
        free_count: Callable[[], int],
        grow: Callable[[int], int],
        ahead: Callable[[], None] = lambda: None,
        hold: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext,
        claim_timeout_s: float = 1.0,
        answer_timeout_s: float = 30.0,
        alive: Callable[[], Exception | None] = lambda: None,
        device: int | None = None,
        peer_prefix_blocks: int | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.first_block = first_block
        self._free_count = free_count
        self._grow = grow
        self._ahead = ahead  # starts a refill of the engine's idle blocks off this thread if they ran low
        #: within it, the idle blocks ``free_count`` counted stay idle but for those ``take`` takes
        self.hold = hold
        self.claim_timeout_s = claim_timeout_s
        self.answer_timeout_s = answer_timeout_s
        self._alive = alive
        self.device = device  # the arena the engine's blocks and prefix chains are in, as the pool names its device
        #: a lookup missing more than this many full blocks asks the pool's peers (:mod:`.remote`); None: never. Only
        #: for an engine on the pool's first arena, the one a remote read fills
        self.peer_prefix_blocks = peer_prefix_blocks if first_block == 0 else None
        self.held: dict[int, int] = {}  # block -> its fenced id; the engine's session holds one ref on it
        #: the engine's own object for each block (vLLM's block pool's list, never resized), if it has one
        self.block_objects: Sequence[Any] | None = None
        #: held blocks the pool's prefix index does not hold: taken from the slab, not committed yet (so they go back
        #: to the slab). Every other held block is committed; kept this way round because a hit's blocks, installed
        #: on the handover's path, are all committed, and a request's new blocks are few
        self.uncommitted: set[int] = set()
        #: every request the engine keeps anything for, from its arrival to its end: its one record
        #: (:mod:`.residentrequest`). A request is taken in within the step that installed its hit, so pins are kept
        #: per request, not per block, and the set of pinned blocks is built only when asked
        self.requests: dict[str, ResidentRequest] = {}
        self._pinning = 0  # records that pin blocks
        self._pinned: set[int] | None = set()  # every pinned block; None: to be built again from the records
        self.counters = ResidentCounters()
        self.handovers = Handovers()
        #: refs a hit took past what its request uses, released at the next step: a handover wakes no thread
        self._spare: list[int] = []
        self.gone: Exception | None = None
        self._lookups: Batcher[tuple[str, list[int], str | None], Hit] = Batcher(
            "kvpool-lookups", self._lookup_many, self._no_hit
        )
        self._claims: Batcher[Claim, Hit] = Batcher("kvpool-claims", self._claim_many, self._no_hit)
        self.writes = PoolWrites(pool, device, self._lose)
        self._lock = threading.Lock()  # a record's ``future`` is set on the input thread, taken on the scheduler's

    def request(self, req_id: str) -> ResidentRequest:
        """The request's record, made on its first mention (an atomic dict operation: any thread)."""
        rec = self.requests.get(req_id)
        return rec if rec is not None else self.requests.setdefault(req_id, ResidentRequest(req_id))

    # -- the pool's health --------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise ``PoolGone`` once the pool stopped answering for this engine's session: from then on the blocks
        it holds are no one's in the pool's books, and a new request could be given a block another engine uses."""
        if self.gone is None:
            lost = self._alive()
            if lost is not None:
                self._lose(lost)
        if self.gone is not None:
            raise PoolGone(
                f"kvpool: the pool that owns this engine's KV memory is gone ({self.gone}); this engine takes no new "
                "work. Restart the pool, then restart the engine (its KV cache lives in the old pool's arena)"
            )

    def _lose(self, why: Exception) -> None:
        if self.gone is None:
            self.gone = why
            log.error("kvpool: lost the pool (%s: %s); the engine stops taking work", type(why).__name__, why)

    # -- blocks for new tokens -----------------------------------------------------------------------------

    def _blocks(self, ids: Sequence[int]) -> list[int]:
        """The engine's block for each fenced id (its index in the engine's arena)."""
        first = self.first_block
        return [(fenced & BLOCK_MASK) - first for fenced in ids]

    def _inside(self, blocks: list[int]) -> bool:
        """Whether every block is one the engine can hold: inside its arena, never the null block 0."""
        return not blocks or (min(blocks) > 0 and max(blocks) < self.num_blocks)

    def free_count(self) -> int:
        """Blocks the engine can take without a round trip (its slab's idle ones). vLLM asks once a request a step:
        this only reads the count; refills go ahead of need (``step``), or once vLLM found too few (``grow``), or
        under the slab's lock where an alloc would leave it below ``low``. The lease is proven once a step
        (``step``), by every ``take`` and before every launch, not here: a count writes nothing, and the proof once
        a running request cost 64 of them a decode step."""
        if self.gone is not None:
            self.check()
        try:
            return self._free_count()
        except LOST as exc:
            self._lose(exc)
            self.check()
            raise

    def grow(self, n: int) -> bool:
        """Ask the pool for ``n`` more idle blocks in the slab now (one round trip); whether it gave any."""
        self.check()
        try:
            got = self._grow(n)
        except PoolExhausted:
            return False
        except LOST as exc:
            self._lose(exc)
            self.check()
            raise
        self.counters.refills += 1
        return got > 0

    def take(self, n: int) -> list[int]:
        """``n`` blocks for new tokens, as the engine numbers them; the slab's first, the pool's if it is dry."""
        self.check()
        try:
            ids = self.pool.alloc(n) if self.device is None else self.pool.alloc(n, self.device)
        except LOST as exc:
            self._lose(exc)
            self.check()
            raise
        held = self.held
        out = self._blocks(ids)
        if not (self._inside(out) and held.keys().isdisjoint(out) and len(set(out)) == len(out)):
            bad = next(b for i, b in enumerate(out) if not 0 < b < self.num_blocks or b in held or b in out[:i])
            raise AssertionError(f"the pool gave block {bad}, which this engine cannot take")
        held.update(zip(out, ids, strict=True))
        self.uncommitted.update(out)
        return out

    # -- hits -----------------------------------------------------------------------------------------------

    def prefetch(
        self, req_id: str, tokens: list[int], claim: str | None = None, digest: str | None = None,
        salt: str | None = None, parker: str | None = None, peer: str | None = None,
    ) -> None:  # fmt: skip
        """Start the pool's answer for a request as it arrives (any thread): the lookup of its prompt's loadable
        prefix among chains of ``salt`` (its KV's identity), or the claim of the handoff its prefill engine parked.
        Either answer holds at most the blocks before the prompt's last token (vLLM computes that one). ``digest``:
        what the handoff's meta must say it holds, and ``parker`` the session that must have parked it, checked as
        the answer is read, where a mismatch releases the handoff and answers nothing. ``peer``: the pool the handoff
        is parked in, if another node's (:mod:`.remote`)."""
        loadable = (len(tokens) - 1) // self.block_size * self.block_size
        if loadable <= 0 or self.gone is not None:
            return
        with self._lock:
            rec = self.request(req_id)
            if rec.future is not None:
                return
            if claim is not None:
                ask = Claim(req_id, claim, time.perf_counter(), len(tokens), digest, parker, peer,
                            tokens if peer else None, salt)  # fmt: skip
                rec.future = self._claims.submit(ask)
            else:
                rec.future = self._lookups.submit((req_id, tokens[:loadable], salt))

    def _no_hit(self, exc: Exception) -> Hit:
        if isinstance(exc, LOST):
            self._lose(exc)
        log.warning("kvpool: the pool's answer failed (%s: %s); those requests compute their prompts",
                    type(exc).__name__, exc)  # fmt: skip
        return NO_HIT

    def _lookup_many(self, asks: list[tuple[str, list[int], str | None]]) -> list[Hit]:
        prompts, salts = [tokens for _, tokens, _ in asks], [s for *_, s in asks]
        found = self.pool.lookup_many(prompts, self.device, salts=salts)
        if self.peer_prefix_blocks is not None:
            found = remote.lookup_many(self.pool, prompts, found, salts, self.peer_prefix_blocks, self.block_size)
        hits = [self._hit(list(h.block_ids), h.num_tokens) for h in found]
        requests = self.requests
        for (rid, *_), hit in zip(asks, hits, strict=True):
            rec = requests.get(rid)
            if rec is not None:  # else it left: its future's callback gives the answer back
                rec.answer = hit
        return hits

    def _hit(self, ids: list[int], num_tokens: int, meta: dict[str, Any] | None = None, claimed: bool = False) -> Hit:
        """An answer as the scheduler will install it, with what can be worked out ahead done on this thread."""
        blocks = self._blocks(ids)
        if not (self._inside(blocks) and len(set(blocks)) == len(blocks)):
            return Hit(ids, num_tokens, meta or {}, None, None, claimed)
        objects = self.block_objects
        found = None if objects is None else list(map(objects.__getitem__, blocks))
        return Hit(ids, num_tokens, meta or {}, blocks, found, claimed)

    def _claim_many(self, asks: list[Claim]) -> list[Hit]:
        keys = [(ask.key, ask.peer) for ask in asks]
        out = []
        prompts: list[remote.Prompt | None] = [(a.tokens, a.salt) if a.tokens else None for a in asks]
        for ask, got in zip(asks, remote.claim_many(self.pool, keys, self.claim_timeout_s, prompts), strict=True):
            if got is None:
                log.warning("kvpool: the handoff for %s was not found; the decode engine computes the prompt itself",
                            ask.req_id)  # fmt: skip
                out.append(NO_HIT)
                continue
            ids = list(got.block_ids)
            full = ask.num_tokens // self.block_size * self.block_size
            if ask.digest is not None and (got.num_tokens != full or got.meta.get("digest") != ask.digest):
                log.warning("kvpool: handoff %s holds another prompt's KV; the decode engine computes the prompt "
                            "itself", ask.req_id)  # fmt: skip
                self._release_ids(ids)
                out.append(NO_HIT)
                continue
            if ask.parker is not None and got.parked_by != ask.parker:
                log.warning("kvpool: the handoff for %s was parked by %r, not by its prefill engine %r; the decode "
                            "engine computes the prompt itself", ask.req_id, got.parked_by,
                            ask.parker)  # fmt: skip
                self._release_ids(ids)
                out.append(NO_HIT)
                continue
            usable = (ask.num_tokens - 1) // self.block_size
            if len(ids) > usable:  # the block of the prompt's last token: vLLM computes it again
                self._release_ids(ids[usable:])
                del ids[usable:]
            hit = self._hit(ids, got.num_tokens, dict(got.meta), claimed=True)
            if hit.blocks is None and not self._inside(self._blocks(hit.ids)):
                log.warning("kvpool: the handoff for %s is in another GPU's arena; the decode engine computes the "
                            "prompt itself (a prefill engine hands over by id only on its own GPU)",
                            ask.req_id)  # fmt: skip
                self.counters.foreign_handoffs += 1
                self._release_ids(hit.ids)
                out.append(NO_HIT)
            else:
                out.append(hit)
        now = time.perf_counter()
        requests = self.requests
        for ask, hit in zip(asks, out, strict=True):
            rec = requests.get(ask.req_id)
            if rec is None:  # it left: its future's callback gives the answer back
                continue
            if hit.ids:  # a claim's time is kept until its request is installed, so only where there is one
                rec.claim_us = (now - ask.arrived) * 1e6
            rec.answer = hit
        return out

    def ready(self, req_id: str, wait_s: float = 0.0) -> bool | None:
        """Whether the pool's answer for a request is back, waiting up to ``wait_s`` for it (None: none was
        asked)."""
        rec = self.requests.get(req_id)
        if rec is None:
            return None
        if rec.answer is not None:
            return True
        future = rec.future
        if future is None:
            return None
        if wait_s > 0:
            began = time.perf_counter()
            futures_wait((future,), wait_s)
            self.handovers.wait_us.append((time.perf_counter() - began) * 1e6)
        return future.done()

    def answer(self, req_id: str, timeout_s: float | None = None) -> Hit | None:
        """The pool's answer for a request (waiting for it if it is on its way, ``answer_timeout_s`` unless told),
        taken: None if none was asked."""
        rec = self.requests.get(req_id)
        if rec is None:
            return None
        hit, rec.answer = rec.answer, None
        future, rec.future = rec.future, None
        rec.to(Phase.ANSWERED)
        if hit is not None:
            return hit
        if future is None:
            return None
        began = time.perf_counter()
        wait_s = self.answer_timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(wait_s)
        except FutureTimeout:
            log.warning("kvpool: no answer from the pool for %s in %.0f s; computing it", req_id, wait_s)
            future.add_done_callback(functools.partial(self._give_back, req_id))
            return NO_HIT
        finally:
            rec.answer = None  # the answer came as the wait ended, or failed (then none was put here)
            self.handovers.wait_us.append((time.perf_counter() - began) * 1e6)

    def _give_back(self, req_id: str, future: Future[Hit]) -> None:
        """An answer nobody will take: its refs go back to the pool."""
        rec = self.requests.get(req_id)
        if rec is not None:
            rec.answer = rec.claim_us = None
        self._release_ids(future.result().ids)

    def install(self, req_id: str, hit: Hit, usable: int) -> tuple[list[int], list[int]]:
        """Take the first ``usable`` blocks of ``hit`` for a request that has not run yet: each becomes held (one
        ref: a ref the hit took on a block held already goes back at the next step) and pinned by the request until
        it is scheduled or finished. Returns the engine's block for each of the prompt's first blocks, in order, and
        those of them the engine held already (which vLLM may be using; the others no request uses).

        On a decode engine's handover path: a request's blocks go in whole, not one Python step per block, where
        that can be helped (the common case: none of them held yet, worked out on the answer's thread)."""
        whole = usable >= len(hit.ids)
        ids = hit.ids if whole else hit.ids[:usable]
        if hit.blocks is not None:
            blocks = hit.blocks if whole else hit.blocks[:usable]
        else:
            blocks = self._blocks(ids)
            if not self._inside(blocks):
                bad = next(b for b in blocks if not 0 < b < self.num_blocks)
                raise AssertionError(f"the pool's hit names block {bad} outside this engine's arena")
        held = self.held
        extra = [] if whole else hit.ids[usable:]
        again: list[int] = []
        if held.keys().isdisjoint(blocks) and (hit.blocks is not None or len(set(blocks)) == len(blocks)):
            held.update(zip(blocks, ids, strict=True))
        else:
            extra = list(extra)
            for block, fenced in zip(blocks, ids, strict=True):
                was = held.get(block)
                if was is None:
                    held[block] = fenced
                elif was != fenced:
                    raise AssertionError(f"block {block} is held as {was} but the pool answered {fenced}")
                else:
                    extra.append(fenced)
                    again.append(block)
        self._pinned = None
        rec = self.request(req_id)
        rec.to(Phase.ANSWERED)
        if rec.pins is None:
            self._pinning += 1
            rec.pins = blocks
        else:
            rec.pins = rec.pins + blocks  # never changed in place
        if extra:
            self._spare.extend(extra)
        claimed, rec.claim_us = rec.claim_us, None
        if claimed is not None and blocks:
            self.handovers.claim_us.append(claimed)
        if blocks:
            self.counters.installed_blocks += len(blocks)
            self.counters.installed_requests += 1
        return blocks, again

    def unpin(self, req_id: str) -> list[int]:
        """The request ran (its hits now count in vLLM's refs) or left: its pins go. Returns the blocks no request
        pins any more, for the caller to ``leave`` where vLLM does not use them either."""
        rec = self.requests.get(req_id)
        blocks = rec.pins if rec is not None else None
        if blocks is None:
            return []
        rec.pins = None  # type: ignore[union-attr]
        self._pinning -= 1
        if not blocks:
            return []
        self._pinned = None
        if not self._pinning:  # the common case: no other request waits with a hit
            return blocks
        return [b for b in dict.fromkeys(blocks) if not self.pinned(b)]

    def placed(self, req_id: str) -> list[int]:
        """vLLM placed the request (its hit is vLLM's refs now): it runs, and its pins go; returns the blocks no
        request pins any more, as :meth:`unpin`."""
        rec = self.request(req_id)
        rec.installed = None
        unpinned = self.unpin(req_id)
        rec.to(Phase.RUNNING)
        return unpinned

    def pinned(self, block: int) -> bool:
        """Whether a waiting request installed ``block``."""
        if not self._pinning:
            return False
        if self._pinned is None:
            self._pinned = {b for rec in self.requests.values() if rec.pins for b in rec.pins}
        return block in self._pinned

    @property
    def pins(self) -> Counter[int]:
        """How many waiting requests installed each pinned block (for tests and logs; built on each call)."""
        return Counter(b for rec in self.requests.values() if rec.pins for b in rec.pins)

    # -- blocks that leave --------------------------------------------------------------------------------

    def leave(self, blocks: Sequence[int]) -> None:
        """Blocks vLLM no longer uses and no request pins: committed ones to the pool's LRU (on the writes thread),
        the others back into the slab now."""
        to_pool: list[int] = []
        to_slab: list[int] = []
        for block in blocks:
            if self.pinned(block):
                continue
            fenced = self.held.pop(block, None)
            if fenced is None:
                continue
            if block in self.uncommitted:
                self.uncommitted.discard(block)
                to_slab.append(fenced)
            else:
                to_pool.append(fenced)
        if to_slab:
            self.counters.left_to_slab += len(to_slab)
            try:
                self.pool.free(to_slab)
            except LOST as exc:
                self._lose(exc)
            except KvpoolError as exc:
                log.error("kvpool: freeing %d blocks into the slab failed: %s", len(to_slab), exc)
        if to_pool:
            self.counters.left_to_pool += len(to_pool)
            self._release_ids(to_pool)

    def _release_ids(self, ids: list[int]) -> None:
        if ids and self.gone is None:
            self.writes.release(ids)

    # -- a request's end ------------------------------------------------------------------------------------

    def finished(self, req_id: str) -> list[int]:
        """The request left (finished, aborted, parked): its record goes, an answer still on its way goes back when
        it comes; returns the blocks it pinned that nobody pins now (for ``leave`` where vLLM does not use them)."""
        unpinned = self.unpin(req_id)
        with self._lock:
            rec = self.requests.pop(req_id, None)
        if rec is not None and rec.future is not None:
            rec.future.add_done_callback(functools.partial(self._give_back, req_id))
        return unpinned

    def check_requests(self) -> None:
        """Assert every request's record is as its phase allows, and the pinned blocks are the records' pins (the
        tests call this after each step)."""
        held = self.held
        pinning = 0
        for rec in list(self.requests.values()):
            rec.check(held)
            pinning += rec.pins is not None
        assert pinning == self._pinning, f"{pinning} records pin blocks, the books say {self._pinning}"
        if self._pinned is not None and self._pinning:
            assert self._pinned == {b for r in self.requests.values() if r.pins for b in r.pins}, "stale pin set"

    def commit(self, blocks: Sequence[int], tokens: list[int], salt: str | None = None) -> int:
        """Give the pool's prefix index the full blocks of ``tokens``, held in ``blocks`` (in order), under ``salt``
        (the KV's identity), that it does not hold yet; call only once every step that wrote them has finished.
        Returns how many were sent."""
        n = min(len(tokens) // self.block_size, len(blocks))
        start = 0
        held, uncommitted = self.held, self.uncommitted
        while start < n and blocks[start] in held and blocks[start] not in uncommitted:
            start += 1
        if start >= n:
            return 0
        try:
            fenced = [self.held[b] for b in blocks[start:n]]
        except KeyError as exc:
            raise AssertionError(f"commit of block {exc} that this engine does not hold") from None
        uncommitted.difference_update(blocks[start:n])
        self.counters.committed_blocks += n - start
        self.writes.commit(fenced, tokens[: n * self.block_size], start, salt)
        return n - start

    def park(
        self, key: str, blocks: Sequence[int], tokens: list[int], meta: dict[str, Any], salt: str | None = None
    ) -> None:
        """Hand a prefilled request's full blocks to its decode engine under ``key``, without copying them: commit
        them (under ``salt``), then park them sealed (only a claim that names ``key`` takes them) with refs of the
        handoff's own (``keep``: the engine keeps its refs while vLLM may still use the blocks). All on the writes
        thread, after this request's commit."""
        self.commit(blocks, tokens, salt)
        full = min(len(tokens) // self.block_size, len(blocks))
        if full == 0:
            return
        self.counters.parked_requests += 1
        fenced = [self.held[b] for b in blocks[:full]]
        self.writes.park(key, fenced, tokens[: full * self.block_size], meta, salt)

    # -- shutting down --------------------------------------------------------------------------------------

    def step(self) -> None:
        """Once a scheduler step: the pool's health, the spare refs of the step's hits back to it, and idle blocks
        asked for ahead of need, so that no later step's allocs wait for a refill."""
        self.check()
        self._release_spare()
        self._ahead()

    def _release_spare(self) -> None:
        spare, self._spare = self._spare, []
        self._release_ids(spare)

    def drain(self) -> None:
        """Wait until every call sent so far reached the pool (tests, benchmarks, shutdown)."""
        self._release_spare()
        for lane in (self._lookups, self._claims, self.writes):
            lane.drain()

    def close(self) -> None:
        with self._lock:
            pending = [(rec.req_id, rec.future) for rec in self.requests.values() if rec.future is not None]
            for rec in self.requests.values():
                rec.future = None
        for req_id, future in pending:
            future.add_done_callback(functools.partial(self._give_back, req_id))
        self._release_spare()
        for lane in (self._lookups, self._claims, self.writes):
            lane.close()
