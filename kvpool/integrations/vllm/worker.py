"""The connector's worker side: copies between vLLM's paged cache and the arena, and the pool calls for saves.

Loads run on a side stream layer by layer, and each layer's attention waits (``wait_for_layer_load``) only for
its own layer's copies, so the copies of later layers overlap the forward of earlier ones; with ``layerwise``
off they run on the forward's stream before the forward. Saves are
copied after the forward on the same stream into blocks of a reserve, and committed (or parked) by the saver's
thread once an event says the copies ran (:mod:`.saver`): the engine's thread makes no pool call in a step. A
load that cannot run (pool restarted, arena gone, a copy failing) reports its vLLM blocks as failed, and vLLM
recomputes those tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpool.arena import Arena
from kvpool.errors import LayoutMismatch, PoolUnavailable
from kvpool.integrations.vllm.kvviews import BlockCopier, kv_views
from kvpool.integrations.vllm.link import PoolLink, log
from kvpool.integrations.vllm.plan import StepPlan
from kvpool.integrations.vllm.saver import Job, Saver
from kvpool.integrations.vllm.settings import check_engine
from kvpool.layout import KVLayout


class WorkerSide:
    def __init__(self, link: PoolLink, layout: KVLayout, reserve: int = 1024, layerwise: bool = False) -> None:
        self.link, self.layout, self.layerwise = link, layout, layerwise
        self._layer_of: dict[str, int] = {}
        self._stream: torch.cuda.Stream | None = None
        self._layer_events: list[torch.cuda.Event] = []
        self.copier: BlockCopier | None = None
        self.arena: Arena | None = None
        self._engine: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.failed: set[int] = set()
        self.saver: Saver | None = None
        self.reserve = reserve
        self.stats = {"loaded_blocks": 0, "load_failures": 0, "saved_blocks": 0}

    def register(self, caches: dict[str, torch.Tensor], layer_of: Callable[[str], int]) -> None:
        """Take vLLM's per-layer caches (refused at start-up if the arena cannot hold them) and map the arena."""
        names = sorted(caches, key=layer_of)
        self._engine = [kv_views(caches[n], self.layout, n) for n in names]
        self._layer_of = {n: i for i, n in enumerate(names)}
        self._bind()
        self.saver = Saver(self.link, self.layout.block_size, self.reserve)
        self.saver.refill()

    def _bind(self) -> bool:
        client = self.link.call("arena", lambda c: c, None)
        if client is None:
            return False
        arena = client.arena()
        check_engine(arena.layout, self.layout, "", [])
        device = self._engine[0][0].device
        if arena.device != device:
            raise LayoutMismatch(f"the kvpool arena is on {arena.device}, this engine's KV on {device}: serve the "
                                 f"pool on the engine's GPU (`kvpool serve --device {device.index}`)")  # fmt: skip
        views = [(arena.k(i), arena.v(i)) for i in range(self.layout.num_layers)]
        self.arena, self.copier = arena, BlockCopier(self._engine, views)
        return True

    def _ready(self, epoch: str) -> bool:
        """Arena mapped and of the pool epoch the plan's blocks belong to."""
        if self.arena is None or self.arena.closed or (epoch and self.arena.epoch != epoch):
            client = self.link.client
            if client is not None and epoch and client.epoch != epoch:
                return False  # the blocks were looked up in a pool that is gone
            try:
                if not self._bind():
                    return False
            except Exception as exc:
                log.warning("kvpool: cannot map the arena (%s)", exc)
                return False
        assert self.arena is not None
        return not epoch or self.arena.epoch == epoch

    # -- loads --------------------------------------------------------------------------------------------

    def load(self, plan: StepPlan) -> None:
        if not plan.loads:
            return
        arena_ids = [b for ld in plan.loads for b in ld.arena_ids]
        engine_ids = [b for ld in plan.loads for b in ld.engine_ids]
        try:
            if not self._ready(plan.epoch):
                raise PoolUnavailable("the pool restarted or cannot be reached")
            assert self.copier is not None
            assert self.arena is not None
            local = self.arena.local_ids(arena_ids)  # pool ids carry generations: the arena is indexed by block
            if self.layerwise and self.copier.device.type == "cuda":
                self._load_layerwise(local, engine_ids)
            else:
                self.copier.load(local, engine_ids)
            self.stats["loaded_blocks"] += len(arena_ids)
        except Exception as exc:
            log.warning("kvpool: loading %d blocks failed (%s); vLLM recomputes them", len(engine_ids), exc)
            self.failed.update(engine_ids)
            self.stats["load_failures"] += 1

    def _load_layerwise(self, arena_ids: list[int], engine_ids: list[int]) -> None:
        """Every layer's copies on a side stream, which first waits for what the forward's stream queued before
        (the vLLM blocks given to these requests may have been read by an earlier step), an event per layer."""
        assert self.copier is not None
        dev = self.copier.device
        main = torch.cuda.current_stream(dev)
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
        self._stream.wait_stream(main)
        events: list[torch.cuda.Event] = []
        self._layer_events = events  # as they are recorded: a failure midway still orders the stream after them
        with torch.cuda.stream(self._stream):
            pairs = self.copier.pairs(arena_ids, engine_ids)
            for i in range(len(self._engine)):
                self.copier.load_layer(i, pairs)
                ev = torch.cuda.Event()
                ev.record(self._stream)
                events.append(ev)

    def wait_layer(self, name: str) -> None:
        """The forward's stream waits for this layer's loads (those of the step, if any)."""
        if self._layer_events:
            i = self._layer_of.get(name, len(self._layer_events))
            ev = self._layer_events[min(i, len(self._layer_events) - 1)]
            assert self.copier is not None
            torch.cuda.current_stream(self.copier.device).wait_event(ev)

    def _join_loads(self) -> None:
        """After the forward: the stream waits for all of the step's loads (a layer vLLM did not wait for)."""
        if self._layer_events:
            assert self.copier is not None
            torch.cuda.current_stream(self.copier.device).wait_event(self._layer_events[-1])
            self._layer_events = []

    def take_failed(self) -> set[int]:
        failed, self.failed = self.failed, set()
        return failed

    # -- saves --------------------------------------------------------------------------------------------

    def save(self, plan: StepPlan) -> None:
        """Copy the step's finished prompts into reserve blocks; the saver commits them once the copies ran."""
        self._join_loads()
        if not plan.saves or self.saver is None or not self._ready(""):
            return
        bs, src, dst, jobs = self.layout.block_size, [], [], []
        for s in plan.saves:
            full = len(s.token_ids) // bs
            skip = min(s.skip, full)
            if skip == full and not s.park:
                continue
            new = self.saver.take(full - skip)
            if new is None:
                continue
            src += s.engine_ids[skip:full]
            dst += new
            jobs.append(Job(s, skip, new))
        if not jobs:
            return
        assert self.copier is not None
        try:
            assert self.arena is not None
            self.copier.save(src, self.arena.local_ids(dst))
        except Exception as exc:  # nothing is committed: the pool never sees half-written blocks
            log.warning("kvpool: saving %d blocks failed (%s)", len(dst), exc)
            self.link.call("free", lambda c: c.free(dst), 0)
            return
        self.stats["saved_blocks"] += len(dst)
        done = None
        if self.copier.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.copier.device))
        self.saver.submit(done, jobs)

    def flush(self) -> None:
        if self.saver is not None:
            self.saver.flush()

    def counters(self) -> dict[str, int]:
        """Blocks copied between vLLM's KV cache and the arena, both ways (what resident mode never does)."""
        copied = self.stats["loaded_blocks"] + self.stats["saved_blocks"]
        return {**self.stats, "copied_blocks": copied, "copied_bytes": copied * self.layout.block_nbytes}

    def close(self) -> None:
        if self.saver is not None:
            self.saver.close()
        self.link.close()
