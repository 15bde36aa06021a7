"""The connector's resident mode: the engine's KV cache is the pool's arena, and blocks move by id, never by copy.

Both sides check at start-up whether this engine can be resident against this pool (:func:`why_not`); where it
cannot (a pool without a kv_packed arena on this engine's GPU or without slabs, a vLLM whose allocation points kvpool
does not know, a model with more than one KV cache group), the connector falls back to copy mode and says why in
one line. Where it can but a setting differs (block size, dtype, layers, heads, head dim, block count), it refuses
to start and names the flag (:func:`check_geometry`).

* The worker side maps the arena and makes vLLM's KV cache allocation return its layer regions
  (:mod:`.kvmemory` on vLLM 0.26, :mod:`.memory` from 0.29), then checks what vLLM bound. It copies nothing, ever.
* The scheduler side keeps the engine's blocks (:mod:`.residency`) under vLLM's own block pool (:mod:`.blockpool`),
  made resident the way this vLLM's generation allows (:mod:`.generations`):
  new blocks from the engine's slab, prefix hits and claimed handoffs installed into vLLM's prefix cache as arena
  blocks, a finished request's full blocks committed to the pool's index, and a prefill for another engine parked
  there by id. A decode engine recomputes the prompt's last partial block (and vLLM its last token, as always).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

from kvpool.errors import KvpoolError, LayoutMismatch
from kvpool.integrations.vllm.identity import EngineIdentity
from kvpool.integrations.vllm.plan import prompt_digest
from kvpool.integrations.vllm.remote import PEER_KEY
from kvpool.integrations.vllm.residency import Hit, PoolGone, Residency
from kvpool.integrations.vllm.residentrequest import Phase, ResidentRequest
from kvpool.integrations.vllm.scheduler import DIGEST_KEY, FROM_KEY, HANDOFF_KEY  # copy mode's keys
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor

if TYPE_CHECKING:
    from kvpool.client import PoolClient
    from kvpool.slab import SlabClient

log = logging.getLogger("vllm.kvpool")

#: how long one scheduler step waits, in all, for answers of requests it would take in for the first time, before it
#: leaves those waiting: a lone request's answer is usually this close, and a step of the idle engine loop costs a
#: millisecond. One wait a step, not one a request: a burst's answers come back together, and 32 requests waiting
#: in turn held a step for 10-16 ms
ANSWER_WAIT_S = 0.002
#: this process's resident scheduler sides: a worker in the same process checks their leases before each launch
SCHEDULERS: weakref.WeakSet[ResidentSchedulerSide] = weakref.WeakSet()


def arena_on(descriptor: ArenaDescriptor, gpu_uuid: str | None) -> ArenaDescriptor | None:
    """The pool's arena on the engine's GPU (by UUID), if it has one there."""
    parts = descriptor.arenas or []
    if not parts:
        return descriptor if descriptor.device is not None and descriptor.device.uuid == gpu_uuid else None
    for part in parts:
        if part.device is not None and part.device.uuid == gpu_uuid:
            return descriptor.part(part.index)
    return None


def why_not(descriptor: ArenaDescriptor, gpu_uuid: str | None, kv_groups: int) -> str | None:
    """Why this engine cannot keep its KV in this pool's arena (None: it can)."""
    if descriptor.backend != "cuda":
        return "the pool's arena is in host memory (kvpool serve --backend cpu); resident mode needs it on the GPU"
    if arena_on(descriptor, gpu_uuid) is None:
        return "no arena of the pool is on this engine's GPU (kvpool serve --devices ... that includes it)"
    if descriptor.layout.order != "kv_packed":
        return f"the pool's arena is {descriptor.layout.order}: start it with --order kv_packed, vLLM's own layout"
    if descriptor.slab_slots <= 0:
        return "the pool serves no reservation slabs: start it with --slabs"
    if kv_groups != 1:
        return f"this model has {kv_groups} KV cache groups (hybrid or sliding-window layers); resident mode holds one"
    missing = missing_hooks()
    if missing:
        return f"this vLLM has no {missing} as resident mode knows it"
    return None


def missing_hooks() -> str | None:
    """The first private vLLM symbol resident mode relies on that this vLLM does not have as its generation names
    it."""
    try:
        from kvpool.integrations.vllm import generations

        moved = generations.drift(generations.current().SURFACE)
    except ImportError as exc:
        return str(exc)
    return moved[0] if moved else None


def check_geometry(descriptor: ArenaDescriptor, engine: KVLayout, engine_blocks: int) -> None:
    """Refuse, naming the flag, an engine whose KV would not be the arena exactly (block id == arena block)."""
    if engine_blocks != descriptor.num_blocks:
        raise LayoutMismatch(
            f"this engine has {engine_blocks} KV blocks, the pool's arena {descriptor.num_blocks}: resident mode "
            f"needs them equal, start vLLM with --num-gpu-blocks-override {descriptor.num_blocks}"
        )
    if engine.model_copy(update={"order": "kv_packed"}) != descriptor.layout:
        raise LayoutMismatch(f"the engine's KV layout {engine} is not the pool's {descriptor.layout}")


class ResidentSchedulerSide:
    """The scheduler side in resident mode: a :class:`Residency` under vLLM's block pool, fed at arrival."""

    def __init__(self, client: SlabClient, descriptor: ArenaDescriptor, block_size: int, claim_timeout_s: float,
                 identity: EngineIdentity, load: bool = True, save: bool = True,
                 device: int | None = None, peer_prefix_blocks: int | None = None) -> None:  # fmt: skip
        from kvpool.integrations.vllm import blockpool, generations

        slab = client.slab
        if slab is None:
            raise LayoutMismatch("the pool gave this engine no slab (all slab regions taken?): raise --slab-regions")
        self.client = client
        self.block_size = block_size
        self.identity = identity
        self.load, self.save = load, save
        #: the records' ``demand`` summed: the new blocks of the requests that arrived and are not placed yet, which
        #: the slab is refilled for off the scheduler's thread, as a burst arrives and after each step
        self.demanded = 0
        self._demand_lock = threading.Lock()  # demands are set on vLLM's input thread, the answers' and the scheduler's
        self._refill_ahead = slab.refill_ahead
        self.residency = Residency(
            client, block_size, descriptor.num_blocks, first_block=descriptor.first_block,
            free_count=lambda: slab.num_idle, grow=slab.ensure_idle, ahead=self._refill_for_demand, hold=slab.holding,
            claim_timeout_s=claim_timeout_s, device=device, peer_prefix_blocks=peer_prefix_blocks,
            alive=lambda: _lapse(client),
        )  # fmt: skip
        self._wait_until: float | None = None  # the end of this step's wait for answers, once a request began it
        self.block_pool: Any = None
        self.generation = generations.current()
        #: this engine's resident ``BlockPool`` class: vLLM 0.26 builds it, later ones' block pool becomes it
        self.pool_class = blockpool.bound(self.residency, self._answer, self._bind, self._later,
                                          self.reset)  # fmt: skip
        self.generation.start_scheduler(self.pool_class)
        slab.refill_ahead()  # the slab starts full, and its refill thread exists before the first burst
        SCHEDULERS.add(self)

    def _bind(self, block_pool: Any) -> None:
        self.block_pool = block_pool

    def adopt(self, manager: Any) -> None:
        """vLLM built its ``KVCacheManager``: make it and its block pool resident (no-op where they are)."""
        from kvpool.integrations.vllm import blockpool

        blockpool.adopt(manager, self.pool_class)

    # -- arrivals -----------------------------------------------------------------------------------------

    def arrive(self, request: Any) -> None:
        """Start the pool's answer: the claim of a handed-over prefill, else a lookup of the prompt's prefix among
        the chains of its identity. A request kept out of the pool (:meth:`EngineIdentity.of`) asks nothing."""
        try:
            self._ask(request)
        finally:
            self._demand(request)

    def _ask(self, request: Any) -> None:
        salt = self.identity.of(request)
        if salt is None:
            return
        params = request.kv_transfer_params or {}
        key = params.get(HANDOFF_KEY)
        if key is None and not self.load:
            return
        prompt = request.prompt_token_ids
        if key is None:
            self.residency.prefetch(request.request_id, prompt, salt=salt)
            return
        # the handoff must hold this prompt's KV of this identity, parked by the engine that says it prefilled it:
        # hashed as it arrives, checked as the claim's answer is read
        self.residency.prefetch(request.request_id, prompt, claim=str(key), digest=prompt_digest(prompt, salt),
                                parker=str(params.get(FROM_KEY, "")), peer=params.get(PEER_KEY),
                                salt=salt)  # fmt: skip

    def _later(self, request: Any) -> bool:
        rec = self.residency.requests.get(request.request_id)
        return rec is not None and rec.later

    def _demand(self, request: Any) -> None:
        """Ask for the new blocks of a request's prompt as it arrives, on the slab's refill thread: a burst bigger
        than the slab's idle blocks then finds them there in its first step, where allocs that ran the slab dry
        waited for a refill round trip each, under the slab's lock, on the scheduler's thread (4 for 64 prompts of
        512 tokens and a 1,024-block slab). A request the pool answers for is counted once its answer is back, less
        its hit: its hit is held for it by then, and a refill that evicts cannot take it."""
        blocks = len(request.prompt_token_ids or ()) // self.block_size + 1
        rec = self.residency.request(request.request_id)
        with self._demand_lock:
            if rec.demand is not None:
                return
            rec.demand = 0
        future = rec.future
        if future is None:
            self._need(rec, blocks)
        else:
            future.add_done_callback(lambda f: self._need(rec, blocks - len(f.result().ids)))

    def _need(self, rec: ResidentRequest, blocks: int) -> None:
        with self._demand_lock:
            if rec.demand is None:  # placed or gone meanwhile
                return
            self.demanded += blocks - rec.demand
            rec.demand = blocks
        self._refill_for_demand()

    def _settle(self, rid: str) -> None:
        """The request was placed or left: the slab is no longer refilled for it."""
        rec = self.residency.requests.get(rid)
        with self._demand_lock:
            if rec is not None and rec.demand is not None:
                self.demanded -= rec.demand
                rec.demand = None

    def _refill_for_demand(self) -> None:
        self._refill_ahead(self.demanded)

    def _answer(self, request: Any) -> Hit | None:
        """What to install for ``request`` before vLLM searches its prefix cache: its hit, if it has one. The pool is
        asked once, however often vLLM schedules the request, and again after a preemption (its blocks went, its
        prefix may be a hit again)."""
        rid = request.request_id
        rec = self.residency.request(rid)
        if rec.asked_at is not None:
            if request.num_preemptions <= rec.asked_at:
                return None
            rec.to(Phase.ARRIVED)
            self.arrive(request)  # preempted since: its blocks went back, and the pool may hold its prefix
        ready = self.residency.ready(rid)
        if ready is None:  # it arrived without word to the connector (no arrival hook): ask now
            self.arrive(request)
            ready = self.residency.ready(rid)
        if ready is False:
            ready = self.residency.ready(rid, self._wait_s(rec))
        if ready is False:
            if rec.since is None:
                rec.since = time.monotonic()
            if time.monotonic() - rec.since < self.residency.answer_timeout_s:
                rec.later = True
                return None
        rec.since = None
        rec.asked_at = request.num_preemptions
        hit = self.residency.answer(rid, None if ready is not False else 0.0)
        return hit if hit is not None and hit.ids else None

    def _wait_s(self, rec: Any) -> float:
        """How long to wait for a request's answer now: what is left of this step's wait, for a request not left
        waiting before (one that was had its wait)."""
        if rec.since is not None:
            return 0.0
        now = time.monotonic()
        if self._wait_until is None:
            self._wait_until = now + ANSWER_WAIT_S
        return max(0.0, self._wait_until - now)

    def deferred(self, request: Any) -> bool:
        """Whether vLLM is to leave ``request`` waiting this step (asked right after its hit search): the pool's
        answer for it is on its way, and the scheduler takes the requests whose answers are back meanwhile, where
        waiting for it would hold them all (a burst's first arrival would run alone while the others queue)."""
        rec = self.residency.requests.get(request.request_id)
        if rec is not None and rec.later:
            rec.later = False
            return True
        return False

    # -- a request's end ------------------------------------------------------------------------------------

    def after_alloc(self, request: Any) -> None:
        """vLLM placed the request: its hits are vLLM's refs now, its pins go."""
        self._settle(request.request_id)
        self._leave(self.residency.placed(request.request_id))

    def finished(self, request: Any, block_ids: list[int]) -> dict[str, Any] | None:
        """Commit the request's computed full blocks (every step that wrote them has ended), or park them for the
        decode engine that ``do_remote_decode`` names; the blocks themselves go when vLLM frees them."""
        self._settle(request.request_id)
        self._leave(self.residency.finished(request.request_id))  # its record goes
        done = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        params = request.kv_transfer_params or {}
        salt = self.identity.of(request)
        if salt is None:
            return None
        if params.get("do_remote_decode"):
            prompt = list(request.prompt_token_ids)
            if done < len(prompt) or len(prompt) < self.block_size:
                return None
            # unguessable and sealed: only the claim that names it takes it, and it says nothing of this engine
            key = secrets.token_urlsafe(18)
            digest = prompt_digest(prompt, salt)
            self.residency.park(key, block_ids, prompt, {"digest": digest}, salt)
            return {HANDOFF_KEY: key, DIGEST_KEY: digest, FROM_KEY: self.client.session.name, "num_tokens": len(prompt)}
        if self.save and done >= self.block_size:
            self.residency.commit(block_ids, list(request.all_token_ids[:done]), salt)
        return None

    def _leave(self, blocks: list[int]) -> None:
        if blocks and self.block_pool is not None:
            self.block_pool.leave(blocks)

    def reset(self) -> None:
        """The engine's prefix cache was reset (a weight update, or asked): a new epoch, sharing nothing computed
        before."""
        self.identity.renew()
        log.info("kvpool: the engine's prefix cache was reset: it shares nothing computed before (epoch %d)",
                 self.identity.epoch)  # fmt: skip

    def step(self) -> None:
        """The end of a scheduler step (vLLM builds the connector's metadata once per ``schedule``)."""
        self._wait_until = None
        self.residency.step()

    def close(self) -> None:
        self.generation.stop_scheduler()
        self.residency.close()
        self.client.close()


class ResidentWorker:
    """The worker side in resident mode: the arena mapped once, vLLM's KV cache allocation pointed at it."""

    def __init__(self, client: PoolClient, descriptor: ArenaDescriptor, layout: KVLayout, kv_cache_config: Any = None,
                 kv_layout: str | None = None) -> None:  # fmt: skip
        """``kv_cache_config``: vLLM's KV plan, and ``kv_layout`` the physical layout vLLM resolved for it (0.29+),
        checked against the arena here, before vLLM allocates."""
        import torch

        from kvpool.integrations.vllm import generations, kvmemory

        self.client = client
        device = descriptor.device.index if descriptor.arenas and descriptor.device is not None else None
        arena = client.arena(descriptor.layout, device=device)
        self.kv = kvmemory.ArenaKV(arena.raw.view(torch.int8), descriptor.layout, descriptor.num_blocks)
        self.generation = generations.current()
        self.runners = self.generation.start_worker(self.kv, _layer_index, kv_cache_config, kv_layout)

    def mem_pool_context(self) -> Any:
        """Where vLLM 0.31+ allocates the KV cache: the arena (None: this vLLM allocates it elsewhere). Always as an
        engine attaching to a live arena (vLLM's zero fill skipped): the pool zeroed the arena when it made it, and
        another engine may already serve from it."""
        return self.generation.mem_pool_context(self.kv, attaching=True)

    def check(self) -> None:
        """Before each launch: raise ``PoolGone`` unless the blocks this step writes are still this engine's (the
        scheduler's lease proven, in this process; the worker's own session too), so that an engine that stalled
        past its lease never writes a block the pool may have given to another."""
        for scheduler in list(SCHEDULERS):
            scheduler.residency.check()
        why = _lapse(self.client)
        if why is not None:
            raise PoolGone(f"kvpool: this engine's pool session lapsed ({why}); it launches nothing more. Restart it")

    def register(self, kv_caches: dict[str, Any]) -> None:
        if self.runners:  # vLLM 0.26: the patched runners recorded which arena layer each of vLLM's layers took
            self.kv.check(kv_caches)
        else:
            from kvpool.integrations.vllm import memory

            memory.check_bound(self.kv, kv_caches, _layer_index)
        log.info("kvpool: resident mode: vLLM's KV cache is the arena's %d layer regions (model runners patched: %s)",
                 len(kv_caches), ", ".join(self.runners) or "none, the memory pool context")  # fmt: skip

    def close(self) -> None:
        self.client.close()  # the mapping stays while the process lives: CUDA graphs hold its addresses


def _lapse(client: PoolClient) -> Exception | None:
    """Why this engine can no longer prove that the pool holds its blocks for it: its session lost, the pool not
    answering, its lease not renewed in time (a stall: the pool may have taken its blocks back), or its slab taken
    back. Checked every step and before every launch."""
    session = client.session
    why = session.lost or session.unreachable or session.lapsed()
    slab = getattr(client, "slab", None)  # the scheduler's SlabClient has one; the worker's plain client none
    if why is None and slab is not None:
        try:
            slab.ensure_mine()
        except KvpoolError as exc:
            return exc
    return why


def _layer_index(name: str) -> int:
    from vllm.model_executor.models.utils import extract_layer_index

    return int(extract_layer_index(name))


def gpu_uuid() -> str | None:
    """The UUID of the GPU this process computes on, as the pool names its arenas' devices."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    except Exception:
        return None
