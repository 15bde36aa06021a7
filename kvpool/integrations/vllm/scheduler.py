"""The connector's scheduler side: how much of a prompt the pool can give, and each step's plan for the worker.

Prefix hits come from the pool's own chain over token ids (``lookup``), so engines share prefixes whatever their
hash seeds. A hit, and a handoff's load too, covers full blocks short of the prompt's last token, exactly what
vLLM's own prefix cache would give: the engine then computes the same tokens in the same batches as with its own
cache, so the tokens it samples are the same bits.

The refs that a lookup or a claim takes stay with this side's session until the request is finished and
``free_delay_steps`` more steps have been planned, long after the worker's copy out of those blocks ran: a block
an engine loads can never be evicted and rewritten while it is being read.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvpool.integrations.vllm import remote
from kvpool.integrations.vllm.link import PoolLink, log
from kvpool.integrations.vllm.plan import Load, Save, StepPlan, Tracked, blocks_for, prompt_digest
from kvpool.integrations.vllm.settings import ConnectorSettings

#: kv_transfer_params keys: a prefill engine's answer carries the handoff to the decode engine's request
HANDOFF_KEY = "kvpool_handoff"
DIGEST_KEY = "kvpool_digest"
FROM_KEY = "kvpool_from"  # the name of the session that parked it (the prefill engine's worker side)


@dataclass
class Scheduled:
    """One request in vLLM's scheduler output, reduced to what the plan needs."""

    req_id: str
    num_computed: int
    num_scheduled: int
    new_blocks: list[int]
    replace_blocks: bool = False  # a new or resumed request: ``new_blocks`` is the whole list
    prompt: list[int] | None = None


class SchedulerSide:
    def __init__(
        self, link: PoolLink, settings: ConnectorSettings, block_size: int, engine_id: str, parker: str = ""
    ) -> None:
        self.link, self.settings, self.block_size, self.engine_id = link, settings, block_size, engine_id
        self.parker = parker  # the session that parks this engine's prefills: its worker side's
        self.reqs: dict[str, Tracked] = {}
        self._loads: list[Load] = []
        # lanes: a burst of arrivals looks up on several sessions at once; a lane's refs go back through it
        self.links = [link] + [
            PoolLink(link.url, f"{link.name}-{i}", link.token, link.layout, link.retry_s, link._connect)
            for i in range(1, settings.lookup_threads)
        ]
        self._lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"kvpool-lookup-{i}") for i in range(len(self.links))]
        self._next_lane = 0
        self._frees: deque[list[tuple[int, list[int]]]] = deque([[] for _ in range(settings.free_delay_steps)])
        self._ahead: dict[str, Future[tuple[list[int], int, int]]] = {}
        #: lookups not sent yet (the prompt's loadable prefix, its salt)
        self._batch: list[tuple[list[int], str | None, Future[tuple[list[int], int, int]]]] = []
        self._claims: list[tuple[list[int], dict[str, Any], str | None, Future[tuple[list[int], int, int]]]] = []
        self._batch_lock = threading.Lock()
        self.epoch = ""

    # -- matching ---------------------------------------------------------------------------------------

    def skip(self, req_id: str) -> None:
        """A request whose KV is not a function of its token ids alone (LoRA, images, a cache salt): never
        loaded from the pool, never saved to it."""
        self.reqs[req_id] = Tracked(prompt=[], saved=True)

    def match(
        self, req_id: str, prompt: list[int], num_computed: int, params: dict[str, Any] | None, salt: str | None = None
    ) -> int:
        """Tokens past ``num_computed`` that the pool can fill for this request (0: none; it computes them), from
        chains of ``salt`` (the request's KV identity). A lookup started on arrival is waited for: its answer is the
        pool's, and vLLM must not schedule without it."""
        old = self.reqs.get(req_id)
        if old is not None:
            self._release(old.held, lane=old.lane)  # asked again (vLLM could not place it, or it was preempted)
        t = self.reqs[req_id] = Tracked(prompt=prompt, saved=old is not None and old.saved, salt=salt)
        params = params or {}
        if params.get("do_remote_decode"):
            t.park = old.park if old is not None and old.park else secrets.token_urlsafe(18)  # unguessable, sealed
        ahead = self._ahead.pop(req_id, None)
        ids, tokens, lane = ahead.result() if ahead is not None else self._find(prompt, params, 0, salt)
        usable = min(self._loadable(prompt), tokens)
        t.pool_blocks = len(ids)
        if not ids or usable <= num_computed:
            self._release(ids, now=True, lane=lane)
            return 0
        t.held, t.lane, t.first_block, t.external = ids, lane, num_computed // self.block_size, usable - num_computed
        return t.external

    def prefetch(self, req_id: str, prompt: list[int], params: dict[str, Any] | None, salt: str | None = None) -> None:
        """Start the pool's answer for a request as it arrives, so that ``match`` finds it ready: the pool
        calls of a burst of arrivals then overlap with each other and with vLLM taking the requests in.

        Prefix lookups go out in batches: those that arrive while a lane's call is under way wait for the next
        call, and all go in it (one round trip for a burst, where one call each queued them one after the other).
        """
        if len(prompt) <= self.block_size or req_id in self._ahead:
            return
        params = dict(params or {})
        if not params.get(HANDOFF_KEY) and not self.settings.load:
            return
        future: Future[tuple[list[int], int, int]] = Future()
        with self._batch_lock:
            if params.get(HANDOFF_KEY):
                self._claims.append((prompt, params, salt, future))
                start, run = len(self._claims) == 1, self._claim_batch
            else:
                self._batch.append((prompt[: self._loadable(prompt)], salt, future))
                start, run = len(self._batch) == 1, self._lookup_batch
        self._ahead[req_id] = future
        if start:
            lane = self._lane()
            self._lanes[lane].submit(run, lane)

    def _loadable(self, prompt: list[int]) -> int:
        """Tokens of the prompt's full blocks before its last token, which vLLM always computes itself."""
        return (len(prompt) - 1) // self.block_size * self.block_size

    def _lane(self) -> int:
        lane = self._next_lane
        self._next_lane = (lane + 1) % len(self._lanes)
        return lane

    def _lookup_batch(self, lane: int) -> None:
        with self._batch_lock:
            batch, self._batch = self._batch, []
        hits = None
        try:
            prompts, salts = [p for p, _, _ in batch], [s for _, s, _ in batch]
            hits = self.links[lane].call("lookup", lambda c: self._lookup_many(c, prompts, salts), None)
        finally:  # every request gets its answer, "nothing in the pool" at worst: none waits forever
            for i, (_, _, future) in enumerate(batch):
                future.set_result((hits[i][0], hits[i][1], lane) if hits is not None else ([], 0, lane))

    def _claim_batch(self, lane: int) -> None:
        """The claims of the decode requests that arrived since the last such call, in one call (pipelined)."""
        with self._batch_lock:
            batch, self._claims = self._claims, []
        claims: list[Any] = [None] * len(batch)
        try:
            keys = [(str(params[HANDOFF_KEY]), params.get(remote.PEER_KEY)) for _, params, _, _ in batch]
            prompts = [(prompt, salt) for prompt, _, salt, _ in batch]
            claims = self.links[lane].call("claim", lambda c: self._claim_many(c, keys, prompts), claims)
        finally:  # every request gets its answer, "nothing to load" at worst: none waits forever
            for claim, (prompt, params, salt, future) in zip(claims, batch, strict=True):
                ids = self._claimed(claim, params, prompt, lane, salt)
                future.set_result((ids, self._loadable(prompt), lane))

    def _find(
        self, prompt: list[int], params: dict[str, Any], lane: int, salt: str | None = None
    ) -> tuple[list[int], int, int]:
        """The pool's blocks for the prompt's loadable prefix (refs taken on ``lane``'s session), the tokens they
        hold, and the lane."""
        usable = self._loadable(prompt)
        if usable <= 0:
            return [], 0, lane
        if params.get(HANDOFF_KEY):
            return self._claim(params, prompt, lane, salt), usable, lane
        if self.settings.load:
            ids, tokens = self.links[lane].call("lookup", lambda c: self._lookup(c, prompt[:usable], salt), ([], 0))
            return ids, tokens, lane
        return [], 0, lane

    def _lookup(self, client: Any, tokens: list[int], salt: str | None) -> tuple[list[int], int]:
        [(ids, num_tokens)] = self._lookup_many(client, [tokens], [salt])
        return ids, num_tokens

    def _lookup_many(
        self, client: Any, prompts: list[list[int]], salts: list[str | None]
    ) -> list[tuple[list[int], int]]:
        hits = client.lookup_many(prompts, salts=salts)
        self.epoch = client.epoch
        if self.settings.peer_prefix_blocks is not None:
            hits = remote.lookup_many(client, prompts, hits, salts, self.settings.peer_prefix_blocks, self.block_size)
        return [(list(h.block_ids), h.num_tokens) for h in hits]

    def _claim_many(
        self, client: Any, keys: list[tuple[str, str | None]], prompts: list[remote.Prompt] | None = None
    ) -> list[Any]:
        """Each ``(key, peer)``'s claim; one parked at a peer pool is read into this one (:mod:`.remote`) and
        indexed there under its prompt."""
        claims = remote.claim_many(client, keys, self.settings.claim_timeout_s, prompts)
        self.epoch = client.epoch
        return claims

    def _claim(self, params: dict[str, Any], prompt: list[int], lane: int, salt: str | None) -> list[int]:
        key = (str(params[HANDOFF_KEY]), params.get(remote.PEER_KEY))
        claims = self.links[lane].call("claim", lambda c: self._claim_many(c, [key], [(prompt, salt)]), [None])
        return self._claimed(claims[0], params, prompt, lane, salt)

    def _claimed(
        self, got: Any, params: dict[str, Any], prompt: list[int], lane: int, salt: str | None = None
    ) -> list[int]:
        """The claimed handoff's ids if there is one, it holds this prompt's KV of this identity, and the pool says
        the prefill engine named in ``params`` parked it; otherwise its refs go back and nothing loads."""
        if got is None:
            log.warning("kvpool: a handoff was not found; the decode engine computes the prompt itself")
            return []
        ids = list(got.block_ids)
        want = params.get(DIGEST_KEY) or got.meta.get("digest")
        full = len(prompt) // self.block_size * self.block_size
        if got.num_tokens != full or got.meta.get("digest") != want or want != prompt_digest(prompt, salt):
            log.warning("kvpool: a handoff holds another prompt's KV; computing the prompt instead")
            self._release(ids, now=True, lane=lane)
            return []
        if got.parked_by != params.get(FROM_KEY):
            log.warning("kvpool: a handoff was parked by %r, not by the prefill engine %r; computing the prompt "
                        "instead", got.parked_by, params.get(FROM_KEY))  # fmt: skip
            self._release(ids, now=True, lane=lane)
            return []
        return ids

    def after_alloc(self, req_id: str, engine_blocks: list[int], num_external: int) -> None:
        t = self.reqs.get(req_id)
        if t is None or not t.held:
            return
        if num_external <= 0:
            self._release(t.held, lane=t.lane)
            t.held = []
            return
        start = t.first_block
        end = blocks_for(start * self.block_size + num_external, self.block_size)
        self._loads.append(Load(req_id, t.held[start:end], list(engine_blocks[start:end])))

    # -- each step ----------------------------------------------------------------------------------------

    def build(self, scheduled: Iterable[Scheduled]) -> StepPlan:
        """The worker's plan for this step; also lets go of refs whose delay has run out."""
        plan = StepPlan(epoch=self.epoch, loads=self._loads)
        self._loads = []
        for s in scheduled:
            t = self.reqs.get(s.req_id)
            if t is None:
                if s.prompt is None:
                    continue
                t = self.reqs[s.req_id] = Tracked(prompt=s.prompt, saved=True)  # its identity unknown: not saved
            t.blocks = list(s.new_blocks) if s.replace_blocks else t.blocks + list(s.new_blocks)
            save = self._save_of(s, t)
            if save is not None:
                plan.saves.append(save)
        self._frees.append([])
        for lane, ids in self._frees.popleft():
            self._release(ids, now=True, lane=lane)
        return plan

    def _save_of(self, s: Scheduled, t: Tracked) -> Save | None:
        n = len(t.prompt)
        if t.saved or s.num_computed + s.num_scheduled < n:
            return None
        t.saved = True
        if t.park is None and (not self.settings.save or n < self.block_size):
            return None
        need = n // self.block_size
        if len(t.blocks) < need or need == 0:
            t.park = None
            return None
        digest = prompt_digest(t.prompt, t.salt) if t.park else ""
        return Save(s.req_id, t.prompt, t.blocks[:need], t.park, digest, min(t.pool_blocks, need), t.salt)

    def finished(self, req_id: str) -> dict[str, Any] | None:
        """Let go of the request; a parked prefill answers with what its decode engine needs to claim it."""
        ahead = self._ahead.pop(req_id, None)
        if ahead is not None:  # finished before vLLM asked: the refs the answer took go back when it comes
            ahead.add_done_callback(lambda f: self._release(f.result()[0], now=True, lane=f.result()[2]))
        t = self.reqs.pop(req_id, None)
        if t is None:
            return None
        self._release(t.held, lane=t.lane)
        if t.park and t.saved:
            return {HANDOFF_KEY: t.park, DIGEST_KEY: prompt_digest(t.prompt, t.salt), FROM_KEY: self.parker,
                    "num_tokens": len(t.prompt)}  # fmt: skip
        return None

    def _release(self, ids: list[int], now: bool = False, lane: int = 0) -> None:
        if not ids:
            return
        if now:  # on the lane's thread: the scheduler's thread makes no pool call
            link = self.links[lane]
            self._lanes[lane].submit(link.call, "free", lambda c: c.free(ids), 0)
        else:
            self._frees[-1].append((lane, ids))

    def drain(self) -> None:
        """Wait until the lookups and frees asked for so far reached the pool."""
        for ex in self._lanes:
            ex.submit(lambda: None).result()

    def close(self) -> None:
        for ex in self._lanes:
            ex.shutdown(wait=True)
        held: list[list[int]] = [[] for _ in self.links]
        for ahead in self._ahead.values():
            ids, _, lane = ahead.result()
            held[lane] += ids
        for t in self.reqs.values():
            held[t.lane] += t.held
        for due in self._frees:
            for lane, ids in due:
                held[lane] += ids
        for link, ids in zip(self.links, held, strict=True):
            if ids:
                link.call("free", lambda c, ids=ids: c.free(ids), 0)
            link.close()
