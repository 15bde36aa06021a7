"""The connector's worker side: copies between vLLM's paged cache and the arena, and the pool calls for saves.

Loads run on the forward's stream before the forward, so attention reads loaded KV without a wait. Saves run
after the forward on the same stream; the stream is synchronized before the blocks are committed or parked,
since a commit makes them readable by every engine on the node. A load that cannot run (pool restarted, arena
gone, a copy failing) reports its vLLM blocks as failed, and vLLM recomputes those tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import torch

from kvpool.arena import Arena
from kvpool.integrations.vllm.kvviews import BlockCopier, kv_views
from kvpool.integrations.vllm.link import PoolLink, log
from kvpool.integrations.vllm.plan import Save, StepPlan
from kvpool.integrations.vllm.settings import check_engine
from kvpool.layout import KVLayout


class WorkerSide:
    def __init__(self, link: PoolLink, layout: KVLayout) -> None:
        self.link, self.layout = link, layout
        self.copier: BlockCopier | None = None
        self.arena: Arena | None = None
        self._engine: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.failed: set[int] = set()
        self.stats = {"loaded_blocks": 0, "saved_blocks": 0, "parked": 0, "load_failures": 0}

    def register(self, caches: dict[str, torch.Tensor], layer_of: Callable[[str], int]) -> None:
        """Take vLLM's per-layer caches (refused at start-up if the arena cannot hold them) and map the arena."""
        names = sorted(caches, key=layer_of)
        self._engine = [kv_views(caches[n], self.layout, n) for n in names]
        self._bind()

    def _bind(self) -> bool:
        client = self.link.call("arena", lambda c: c, None)
        if client is None:
            return False
        arena = client.arena()
        check_engine(arena.layout, self.layout, "", [])
        device = self._engine[0][0].device
        if arena.device != device:
            raise RuntimeError(f"the kvpool arena is on {arena.device}, this engine's KV on {device}: serve the "
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
                raise RuntimeError("the pool restarted or cannot be reached")
            assert self.copier is not None
            self.copier.load(arena_ids, engine_ids)
            self.stats["loaded_blocks"] += len(arena_ids)
        except Exception as exc:
            log.warning("kvpool: loading %d blocks failed (%s); vLLM recomputes them", len(engine_ids), exc)
            self.failed.update(engine_ids)
            self.stats["load_failures"] += 1

    def take_failed(self) -> set[int]:
        failed, self.failed = self.failed, set()
        return failed

    # -- saves --------------------------------------------------------------------------------------------

    def save(self, plan: StepPlan) -> None:
        if not plan.saves or not self._ready(""):
            return
        jobs = [job for job in (self._prepare(s) for s in plan.saves) if job is not None]
        if not jobs:
            return
        src = [b for s, hit, new in jobs for b in s.engine_ids[len(hit) :]]
        dst = [b for _, _, new in jobs for b in new]
        assert self.copier is not None
        try:
            self.copier.save(src, dst)
            if self.copier.device.type == "cuda":
                torch.cuda.current_stream(self.copier.device).synchronize()
        except Exception as exc:
            log.warning("kvpool: saving %d blocks failed (%s)", len(dst), exc)
            held = [b for _, hit, new in jobs for b in hit + new]
            self.link.call("free", lambda c: c.free(held), 0)
            return
        self.stats["saved_blocks"] += len(dst)
        for s, hit, new in jobs:
            self._finish(s, hit + new)

    def _prepare(self, s: Save) -> tuple[Save, list[int], list[int]] | None:
        """The blocks the pool has already (refs taken) and new ones for the rest; None if the pool said no."""
        bs = self.layout.block_size
        full = len(s.token_ids) // bs
        total = full
        hit = self.link.call("lookup", lambda c: list(c.lookup(s.token_ids[: full * bs]).block_ids), None)
        if hit is None:
            return None
        if len(hit) == total and not s.park:
            self.link.call("free", lambda c: c.free(hit), 0)
            return None
        new = self.link.call("alloc", lambda c: c.alloc(total - len(hit)), None)
        if new is None:
            self.link.call("free", lambda c: c.free(hit), 0)
            return None
        return s, hit, new

    def _finish(self, s: Save, ids: list[int]) -> None:
        bs = self.layout.block_size
        full = len(s.token_ids) // bs
        if full:
            self.link.call("commit", lambda c: c.commit(ids, s.token_ids[: full * bs]), None)
        if s.park:
            meta = {"digest": s.digest}
            parked = self.link.call("handoff", lambda c: c.handoff(s.park, array("i", ids), full * bs, meta), None)
            if parked is not None:
                self.stats["parked"] += 1
                return
            log.warning("kvpool: parking %s failed; its decode engine computes the prompt itself", s.park)
        self.link.call("free", lambda c: c.free(ids), 0)

    def close(self) -> None:
        self.link.close()
