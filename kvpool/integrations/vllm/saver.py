"""The worker's saves, off the engine's critical path: a thread that commits and parks what the forward wrote.

A save's pool calls wait for the copies out of vLLM's blocks and take the GIL back after every socket wait; on the
engine's thread they added tens of milliseconds to the steps that finish prompts. Here the engine's thread only
takes arena blocks from a reserve this thread keeps allocated, launches the copies and records an event; this
thread waits on the event, then talks to the pool. A committed block is thus never readable before its bytes are
written. A step's prompts are saved in one write: for each, a commit past the prefix the pool held when it was
matched, which lets go of the new blocks too. A step's prefills parked for decode engines need their whole
prompts' ids: their prefixes are looked up, then all are committed and parked, a write for each of the three.
"""

from __future__ import annotations

import queue
import threading
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvpool.integrations.vllm.link import PoolLink, log
from kvpool.integrations.vllm.plan import Save


@dataclass
class Job:
    save: Save
    skip: int  # leading blocks the pool held at the match: committed past, or looked up again to park them
    new: list[int]  # reserve blocks the copies wrote the rest into


class Saver:
    def __init__(self, link: PoolLink, block_size: int, reserve: int) -> None:
        self.link, self.block_size, self.target = link, block_size, reserve
        self._reserve: deque[int] = deque()
        self._lock = threading.Lock()
        self._jobs: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.stats = {"saved_blocks": 0, "parked": 0, "skipped_no_reserve": 0}
        self._thread = threading.Thread(target=self._run, name="kvpool-saver", daemon=True)
        self._thread.start()

    def take(self, n: int) -> list[int] | None:
        """``n`` arena blocks from the reserve, or None (that save is dropped) if it runs short."""
        with self._lock:
            if len(self._reserve) < n:
                self.stats["skipped_no_reserve"] += 1
                self._jobs.put(("refill",))
                return None
            return [self._reserve.popleft() for _ in range(n)]

    def submit(self, done: Any, jobs: list[Job]) -> None:
        """``done``: a CUDA event recorded after the copies (None when they ran synchronously)."""
        self._jobs.put(("jobs", done, jobs))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every save submitted so far reached the pool (and the reserve was topped up)."""
        reached = threading.Event()
        self._jobs.put(("flush", reached))
        return reached.wait(timeout_s)

    def refill(self) -> None:
        with self._lock:
            want = self.target - len(self._reserve)
        if want > self.target // 2:
            got = self.link.call("alloc", lambda c: c.alloc(want), None)
            if got:
                with self._lock:
                    self._reserve.extend(got)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item[0] == "stop":
                return
            if item[0] == "jobs":
                _, done, jobs = item
                if done is not None:
                    done.synchronize()
                self._commit([job for job in jobs if not job.save.park])
                self._park([job for job in jobs if job.save.park])
            if self._jobs.empty() or item[0] == "flush":
                self.refill()
            if item[0] == "flush":
                item[1].set()

    def _commit(self, jobs: list[Job]) -> None:
        """A step's saves in one write: each a commit past the prefix the pool held at the match, letting go of the
        new blocks."""
        if not jobs:
            return
        bs = self.block_size
        commits = [(job.new, job.save.token_ids[: len(job.save.token_ids) // bs * bs], job.skip) for job in jobs]
        salts = [job.save.salt for job in jobs]
        done = self.link.call("commit", lambda c: c.commit_many(commits, release=True, salts=salts), [None] * len(jobs))
        refused: list[int] = []  # or the pool is gone: then it releases the session's refs itself
        for job, got in zip(jobs, done, strict=True):
            if got is None:
                refused += job.new
            elif not got.missing:
                self.stats["saved_blocks"] += len(job.new)
        self._free(refused)

    def _park(self, jobs: list[Job]) -> None:
        """A step's prefills for decode engines, in a write per kind of call: each handoff needs every id of its
        prompt, so the prefixes the pool held at the match are looked up, then all are committed, then parked."""
        if not jobs:
            return
        bs = self.block_size
        held = [job for job in jobs if job.skip]
        prefixes = [job.save.token_ids[: job.skip * bs] for job in held]
        found = []  # a pool that cannot answer gives no hits: those prompts are not parked, their blocks freed
        if held:
            salts = [job.save.salt for job in held]
            found = self.link.call("lookup", lambda c: c.lookup_many(prefixes, salts=salts), [])
        hits = {id(job): list(hit.block_ids) for job, hit in zip(held, found, strict=False)}
        ready: list[tuple[Job, list[int]]] = []
        gone: list[int] = []
        for job in jobs:
            hit = hits.get(id(job), [])
            if len(hit) < job.skip:  # evicted meanwhile (or not looked up): the chain has a gap
                gone += hit + job.new
            else:
                ready.append((job, hit + job.new))
        self._free(gone)
        if not ready:
            return
        full = [len(job.save.token_ids) // bs * bs for job, _ in ready]
        commits = [(ids, job.save.token_ids[:n], 0) for (job, ids), n in zip(ready, full, strict=True)]
        salts = [job.save.salt for job, _ in ready]
        self.link.call("commit", lambda c: c.commit_many(commits, salts=salts), [])
        parks = [(str(job.save.park), array("q", ids), n, {"digest": job.save.digest})
                 for (job, ids), n in zip(ready, full, strict=True)]  # fmt: skip
        done = self.link.call("handoff", lambda c: c.handoff_many(parks, sealed=True), [None] * len(ready))
        failed: list[int] = []
        for (job, ids), parked in zip(ready, done, strict=True):
            self.stats["saved_blocks"] += len(job.new)
            if parked is not None:
                self.stats["parked"] += 1
                continue
            log.warning("kvpool: parking %s failed; its decode engine computes the prompt itself", job.save.req_id)
            failed += ids
        self._free(failed)

    def _free(self, ids: list[int]) -> None:
        if ids:
            self.link.call("free", lambda c: c.free(ids), 0)

    def close(self) -> None:
        self.flush()
        self._jobs.put(("stop",))
        self._thread.join(timeout=10)
        with self._lock:
            left = list(self._reserve)
            self._reserve.clear()
        self._free(left)
