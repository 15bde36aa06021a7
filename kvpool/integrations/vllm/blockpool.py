"""vLLM's block pool in resident mode: the engine's blocks come from the pool's arena and go back to it.

The engine's one ``BlockPool`` becomes a subclass that keeps its free blocks in the engine's slab
(:class:`.residency.Residency`) instead of a private queue, and its ``KVCacheManager`` one whose
``get_computed_blocks`` hands vLLM what the pool answered for a request (another engine's prefix, a claimed
handoff) as the request's hit, arena blocks taken as if this engine had computed them, followed by what vLLM's own
map holds past them, and whose ``allocate_slots`` refills the slab once before it says no. :func:`adopt` swaps the
class of those two objects once vLLM built them (vLLM 0.29+: no vLLM attribute is replaced); :func:`install`
patches vLLM's construction site and manager instead (vLLM 0.26, whose connector never sees the manager). Which one
runs is the vLLM generation's choice (:mod:`.generations`).

Everything else of vLLM's (hashing, ref counts, caching of full blocks, the scheduler) runs unchanged. vLLM's map
holds only blocks the engine holds a pool ref on, so a hit in it is never a recycled block.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from vllm.v1.core import kv_cache_coordinator
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, make_block_hash_with_group_id

from kvpool.integrations.vllm.residency import Hit, Residency

log = logging.getLogger("vllm.kvpool")

_WRAPPED = "_kvpool_resident"


class ResidentBlockPool(BlockPool):
    """A ``BlockPool`` whose free blocks are the engine's slab in the pool's arena (block id == arena block)."""

    residency: Residency
    #: the pool's answer for a request, taken once (it holds no block past the prompt's last token's)
    on_request: Callable[[Any], Hit | None]
    #: told of the block pool once it is built (the connector's scheduler side frees through it)
    on_built: Callable[[ResidentBlockPool], None]
    #: whether vLLM is to leave a request waiting this step (its pool answer on the way): it needs no search
    waits: Callable[[Any], bool]
    #: told when vLLM resets the engine's prefix cache (a new epoch of the engine's KV)
    on_reset: Callable[[], None]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._become_resident()

    def _become_resident(self) -> None:
        """Take over a block pool vLLM just built (no request has a block yet)."""
        # block 0 is the null block (popped by the base class); the rest are the pool's until it gives them
        self.free_block_queue = FreeKVCacheBlockQueue([])
        self.residency.block_objects = self.blocks  # an answer's blocks are looked up on the thread that read it
        #: held blocks no request uses (ref 0) that a waiting request pinned: what vLLM's own pool would count as
        #: evictable, and what vLLM counts as taken from the free blocks when a request's hit touches them
        self.waiting: set[int] = set()
        #: the request vLLM is allocating for, if it is (see ``allocating``)
        self.asking: Any = None
        self.on_built(self)

    # -- allocation ---------------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """The slab's idle blocks, and the hit blocks no request uses yet of the request vLLM is allocating for:
        vLLM asks for room for a request's new blocks *and* those (which its own pool keeps among the free ones), so
        without them a hit larger than the slab's idle blocks would never fit. Other waiting requests' hits are not
        this request's to take: counting them let vLLM ask for blocks the slab did not have (outside an allocation,
        for vLLM's usage figures, they count)."""
        free = self.residency.free_count()
        asking = self.asking
        if asking is None:
            return free + len(self.waiting)
        rec = self.residency.requests.get(asking.request_id)
        pins = rec.pins if rec is not None else None
        return free + (len(self.waiting.intersection(pins)) if pins else 0)

    def get_usage(self) -> float:
        """The share of the arena this engine holds."""
        return len(self.residency.held) / max(1, self.num_gpu_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks <= 0:
            return []
        ids = self.residency.take(num_blocks)
        out = []
        for block_id in ids:
            block = self.blocks[block_id]
            if block.ref_cnt != 0 or block.block_hash is not None:
                raise AssertionError(f"kvpool gave block {block_id}, which vLLM still uses (ref {block.ref_cnt})")
            block.ref_cnt = 1
            if self.metrics_collector:
                self.metrics_collector.on_block_allocated(block)
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        waiting = self.waiting
        for block in blocks:
            if block.ref_cnt == 0:
                waiting.discard(block.block_id)
            block.ref_cnt += 1
            if self.metrics_collector:
                self.metrics_collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        gone = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                gone.append(block.block_id)
        self.leave(gone)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock], on_reuse: Callable[[KVCacheBlock], None]) -> None:
        """vLLM 0.31+'s sparse attention keeps reading released blocks until they are reused: in resident mode a
        released block may be another engine's at once, so it is refused (such models are refused at start-up)."""
        raise NotImplementedError("kvpool: resident mode cannot keep released blocks readable (sparse attention)")

    def leave(self, block_ids: Sequence[int]) -> None:
        """Blocks no request of this engine uses: out of vLLM's prefix-cache map (unless a waiting request pinned
        them), and back to the slab or the pool."""
        out = []
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt != 0:
                continue
            if self.residency.pinned(block_id):
                self.waiting.add(block_id)
                continue
            self.waiting.discard(block_id)
            if self.metrics_collector:
                self.metrics_collector.on_block_evicted(block)
            self._emit_block_removed_events(self._remove_cached_block_hashes(block))
            out.append(block_id)
        self.residency.leave(out)

    def reset_prefix_cache(self) -> bool:
        """Forget this engine's view of the prefix cache, and move the engine to a new epoch: what it computes from
        now on (after a weight update, say) is never found under what it or others computed before. The pool's
        index, shared with other engines, stays."""
        for block in self.blocks:
            if block.ref_cnt == 0 and not block.is_null and block.block_hash is not None:
                self._remove_cached_block_hashes(block)
        self.on_reset()
        return True

    # -- hits from the pool ---------------------------------------------------------------------------------

    def install(self, request: Any) -> tuple[list[int], Hit] | None:
        """Take what the pool answered for ``request`` (held and pinned for it): the engine's blocks of the hit, and
        the answer; None if there is nothing to take. What was installed is kept in the request's record until vLLM
        places it: found again when vLLM asks again (its first allocation failed, or it did not get to it)."""
        rec = self.residency.requests.get(request.request_id)
        if rec is not None and rec.installed is not None:
            return rec.installed
        hit = self.on_request(request)
        if hit is None:
            return None
        blocks, again = self.residency.install(request.request_id, hit, len(hit.ids))
        self.waiting.update(blocks)  # blocks new to the engine: no request uses them
        for block_id in again:
            if self.blocks[block_id].ref_cnt:
                self.waiting.discard(block_id)
        self.residency.request(request.request_id).installed = blocks, hit
        return blocks, hit

    def hit_blocks(self, request: Any, blocks: list[int], hit: Hit) -> list[KVCacheBlock]:
        """The request's hit as vLLM's search would give it, without the search: the pool's blocks, then (after a
        lookup) whatever of the request's next blocks vLLM's own map holds, blocks this engine computed and has not
        committed yet. A handover then costs no pass over the ids: the answer's thread looked its blocks up."""
        found = hit.found
        if found is None or len(found) != len(blocks):
            found = list(map(self.blocks.__getitem__, blocks))
        if hit.claimed:
            return found
        found = list(found)
        hashes = request.block_hashes
        for i in range(len(found), min(len(hashes), (request.num_tokens - 1) // self.hash_block_size)):
            got = self.get_cached_block(hashes[i], [0])
            if got is None:
                break
            found.append(got[0])
        return found

    def insert(self, request: Any, blocks: list[int]) -> None:
        """Put the pool's hit into vLLM's map under the request's own block hashes (vLLM's hash seed differs between
        engines; the pool's chains are over token ids), for vLLM's own search to find."""
        hashes = request.block_hashes
        size = self.hash_block_size
        for i, block_id in enumerate(blocks):
            key = make_block_hash_with_group_id(hashes[i], 0)
            self._insert_block_hash(key, self.blocks[block_id], num_tokens=(i + 1) * size)


def _arity() -> int:
    """How many values vLLM's ``get_computed_blocks`` returns (0.26: the hit, its tokens and a shared-prefix
    boundary; two where there is no boundary), or 0 if its annotation says otherwise: then a handoff's blocks go
    through vLLM's own search like any hit."""
    annotation = inspect.signature(KVCacheManager.get_computed_blocks).return_annotation
    if isinstance(annotation, str):
        names = [a.strip().rsplit(".", 1)[-1] for a in annotation.removeprefix("tuple[").removesuffix("]").split(",")]
    else:
        names = [getattr(a, "__name__", "") for a in typing.get_args(annotation)]
    if names in (["KVCacheBlocks", "int"], ["KVCacheBlocks", "int", "int"]):
        return len(names)
    return 0


_ARITY = _arity()


def bound(
    residency: Residency,
    on_request: Callable[[Any], Hit | None],
    on_built: Callable[[ResidentBlockPool], None],
    waits: Callable[[Any], bool] = lambda request: False,
    on_reset: Callable[[], None] = lambda: None,
) -> type[ResidentBlockPool]:
    """The resident ``BlockPool`` class of one engine, bound to its ``residency``."""

    class Bound(ResidentBlockPool):
        pass

    Bound.residency = residency
    Bound.on_request = staticmethod(on_request)  # type: ignore[assignment]
    Bound.on_built = staticmethod(on_built)  # type: ignore[assignment]
    Bound.waits = staticmethod(waits)  # type: ignore[assignment]
    Bound.on_reset = staticmethod(on_reset)  # type: ignore[assignment]
    if not _ARITY:
        log.warning(
            "kvpool: this vLLM's KVCacheManager.get_computed_blocks is not annotated as resident mode knows it (or "
            "something wrapped it without functools.wraps): the pool's hits go through vLLM's own prefix search, a "
            "little slower, and a request whose answer is not back is searched for anyway"
        )
    return Bound


def adopt(manager: Any, pool_class: type[ResidentBlockPool]) -> None:
    """Make a ``KVCacheManager`` vLLM just built resident, by the class of its objects alone: its one ``BlockPool``
    (shared by its coordinator and every single-type manager) becomes ``pool_class``, and the manager a subclass
    that installs pool answers and refills the slab. A manager already resident is left as it is."""
    pool = manager.block_pool
    if isinstance(pool, ResidentBlockPool):
        return
    if type(pool) is not BlockPool:
        raise TypeError(
            f"kvpool: this engine's block pool is a {type(pool).__qualname__}, not vLLM's BlockPool: resident mode "
            "cannot take it over (serve it in copy mode)"
        )
    pool.__class__ = pool_class
    pool._become_resident()
    manager.__class__ = _resident_manager(type(manager))


@functools.cache
def _resident_manager(base: type) -> type:
    return type(f"Resident{base.__name__}", (ResidentManager, base), {})


class ResidentManager:
    """Mixed ahead of vLLM's ``KVCacheManager`` (:func:`adopt`): the pool's hits without a search, and a slab
    refill before a no. Both pass anything vLLM adds to the two calls through."""

    def get_computed_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        original = super().get_computed_blocks  # type: ignore[misc]
        if any(a is not None for a in (*args, *kwargs.values())):  # a bound on the hit (0.33): vLLM's own search
            return _computed(lambda m, r: original(r, *args, **kwargs), self, request, searched=True)
        return _computed(lambda m, r: original(r), self, request)

    def allocate_slots(self, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        original = super().allocate_slots  # type: ignore[misc]
        return _slots(lambda m, *a, **k: original(*a, **k), self, request, num_new_tokens, *args, **kwargs)


def install(pool_class: type[ResidentBlockPool]) -> None:
    """vLLM 0.26: from now on, the ``BlockPool`` this process's next ``KVCacheManager`` builds is ``pool_class``;
    and ``KVCacheManager`` installs pool answers and refills the slab (once per process)."""
    kv_cache_coordinator.BlockPool = pool_class  # type: ignore[misc]
    if not getattr(KVCacheManager.get_computed_blocks, _WRAPPED, False):
        KVCacheManager.get_computed_blocks = _installing(KVCacheManager.get_computed_blocks)  # type: ignore[method-assign]
        KVCacheManager.allocate_slots = _refilling(KVCacheManager.allocate_slots)  # type: ignore[method-assign]


def uninstall() -> None:
    """Build plain ``BlockPool`` objects again (the wrappers stay: they act only on a resident pool)."""
    kv_cache_coordinator.BlockPool = BlockPool  # type: ignore[misc]


def _installing(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_computed_blocks(manager: Any, request: Any) -> Any:
        return _computed(original, manager, request)

    setattr(get_computed_blocks, _WRAPPED, True)
    return get_computed_blocks


def _computed(original: Callable[[Any, Any], Any], manager: Any, request: Any, searched: bool = False) -> Any:
    """vLLM's ``get_computed_blocks`` for a resident pool: the pool's hit as the request's, without vLLM's search
    where vLLM's hit path is known (else, or ``searched``, put into vLLM's map for its own search to find)."""
    pool = manager.block_pool
    if not isinstance(pool, ResidentBlockPool) or not manager.enable_caching:
        return original(manager, request)
    began = time.perf_counter()
    taken = pool.install(request)
    if taken is None:
        if _ARITY and not searched and pool.waits(request):  # vLLM leaves it waiting: its search would go to waste
            return (manager.empty_kv_cache_blocks, 0, 0)[:_ARITY]
        return original(manager, request)
    blocks, hit = taken
    if (not _ARITY or searched or getattr(request, "skip_reading_prefix_cache", False)
            or _reports_hits(manager, request)):  # fmt: skip
        pool.insert(request, blocks)  # vLLM's own hit path, whatever it does besides the search
        return original(manager, request)
    found = pool.hit_blocks(request, blocks, hit)
    tokens = len(found) * pool.hash_block_size
    if manager.log_stats and manager.prefix_cache_stats is not None:
        manager.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=tokens,
                                          preempted=request.num_preemptions > 0)  # fmt: skip
    computed = manager.create_kv_cache_blocks((found,))
    if hit.claimed:
        pool.residency.handovers.taken_in_us.append((time.perf_counter() - began) * 1e6)
    return (computed, tokens, 0)[:_ARITY]


def _reports_hits(manager: Any, request: Any) -> bool:
    """Whether vLLM emits a KV event for each block of this request's hit (``kv_cache_report_mode`` "full"), which
    its own hit path does."""
    return bool(manager.enable_kv_cache_events) and getattr(request, "kv_cache_report_mode", "") == "full"


def _refilling(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def allocate_slots(manager: Any, request: Any, num_new_tokens: int, *args: Any, **kwargs: Any) -> Any:
        return _slots(original, manager, request, num_new_tokens, *args, **kwargs)

    setattr(allocate_slots, _WRAPPED, True)
    return allocate_slots


def _slots(original: Callable[..., Any], manager: Any, request: Any, num_new_tokens: int, *args: Any,
           **kwargs: Any) -> Any:  # fmt: skip
    pool = manager.block_pool
    if not isinstance(pool, ResidentBlockPool):
        return original(manager, request, num_new_tokens, *args, **kwargs)
    # within the allocation: the free blocks counted are this request's to take, and the slab keeps them idle
    pool.asking = request
    try:
        with pool.residency.hold():
            return _allocate(original, manager, pool, request, num_new_tokens, *args, **kwargs)
    finally:
        pool.asking = None


def _allocate(original: Callable[..., Any], manager: Any, pool: ResidentBlockPool, request: Any, num_new_tokens: int,
              *args: Any, **kwargs: Any) -> Any:  # fmt: skip
    """vLLM's allocation; where the slab ran short, what this request could need taken from the pool in one call and
    the allocation tried once more. A full pool is a full cache (None: vLLM preempts, or leaves the request
    waiting), never an error."""
    blocks = original(manager, request, num_new_tokens, *args, **kwargs)
    if blocks is not None:
        return blocks
    size = pool.hash_block_size
    tokens = num_new_tokens + kwargs.get("num_lookahead_tokens", 0) + kwargs.get("num_external_computed_tokens", 0)
    need = -(-tokens // size) + 1
    if kwargs.get("full_sequence_must_fit"):
        need = max(need, -(-request.num_tokens // size))
    if pool.residency.grow(need):
        return original(manager, request, num_new_tokens, *args, **kwargs)
    return None
