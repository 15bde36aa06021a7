"""The decode worker when the pool runs out of blocks: preempted requests are recomputed (or wait with their
blocks) and still produce the tokens of an unhurried run; only a request that can do neither is dropped."""

from __future__ import annotations

import time
from array import array

import pytest

from kvpool.client import Claim
from kvpool.errors import HandoffNotFound, PoolExhausted
from kvpool.protocol import LookupResponse
from kvpool.workers.decode import DecodeWorker
from kvpool.workers.kvcache import layout_for, private_kv_caches
from kvpool.workers.model import LlamaConfig, LlamaModel
from kvpool.workers.monolithic import greedy_generate
from kvpool.workers.request import HandoffMeta
from kvpool.workers.sequence import blocks_needed, greedy

CONFIG = LlamaConfig(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip
BS = 4


class TinyPool:
    """A pool's books over few blocks: ref counts, committed prompt blocks that stay cached (and evictable) at
    ref 0 and are found again by ``lookup``, parked handoffs."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks))
        self.refs: dict[int, int] = {}
        self.index: dict[tuple[str | int | None, ...], int] = {}  # (salt, token prefix ending a block) -> that block
        self.parked: list[Claim] = []
        self.hit_blocks = 0

    def _evictable(self) -> list[int]:
        return [b for b in self.index.values() if b not in self.refs]

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free_ids) + len(self._evictable()):
            raise PoolExhausted(f"{n} blocks asked, {len(self.free_ids)} free")
        while len(self.free_ids) < n:
            victim = self._evictable()[0]
            self.index = {k: b for k, b in self.index.items() if b != victim}
            self.free_ids.append(victim)
        taken, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        self.refs.update(dict.fromkeys(taken, 1))
        return taken

    def free(self, ids: list[int]) -> int:
        for b in ids:
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
                if b not in self.index.values():
                    self.free_ids.append(b)
        return len(ids)

    def commit(self, block_ids: list[int], token_ids: list[int], salt: str | None = None) -> None:
        for i in range(len(token_ids) // BS):
            self.index.setdefault((salt, *token_ids[: (i + 1) * BS]), block_ids[i])

    def lookup(self, token_ids: list[int], salt: str | None = None) -> LookupResponse:
        found = []
        while (key := (salt, *token_ids[: (len(found) + 1) * BS])) in self.index and len(key) > len(found) * BS + BS:
            found.append(self.index[key])
            self.refs[found[-1]] = self.refs.get(found[-1], 0) + 1
        self.hit_blocks += len(found)
        return LookupResponse(block_ids=found, num_tokens=len(found) * BS)

    def claim(self, request_id: str | None = None, timeout_s: float = 0.0) -> Claim:
        if not self.parked:
            raise HandoffNotFound("nothing parked")
        return self.parked.pop(0)

    def confirm(self) -> None:
        pass


def run(
    prompts: list[list[int]], new_tokens: list[int], num_blocks: int, send_prompt: bool
) -> tuple[list[dict], TinyPool]:
    """Prefill every prompt into the pool, park it, and let a decode worker of batch 4 take them all."""
    model = LlamaModel.random(CONFIG, seed=3)
    caches = private_kv_caches(layout_for(CONFIG, BS, "float32"), num_blocks, fill=float("nan"))
    pool = TinyPool(num_blocks)
    for i, (prompt, n) in enumerate(zip(prompts, new_tokens, strict=True)):
        table = pool.alloc(blocks_needed(len(prompt), BS))
        first = greedy(model.prefill(prompt, table, 0, caches)[None])[0]
        pool.commit(table, prompt)  # as the prefill worker does: full prompt blocks become shareable
        meta = HandoffMeta(len(prompt), first, n, time.time(), time.time(), len(prompt), 0,
                           prompt=prompt if send_prompt else None)  # fmt: skip
        pool.parked.append(Claim(f"r{i}", len(prompt), meta.to_dict(), array("i", table)))
    worker = DecodeWorker(pool, model, caches, BS, max_batch=4)  # type: ignore[arg-type]
    records: list[dict] = []
    for _ in range(500):
        if not (pool.parked or worker.running or worker.waiting):
            break
        records += worker.admit(4, 0.0)
        records += worker.step()
    assert not pool.refs, "blocks left in use"
    assert sorted(pool.free_ids + pool._evictable()) == list(range(num_blocks))
    expected = greedy_generate(model, prompts, max(new_tokens), layout_for(CONFIG, BS, "float32"))
    for r in records:
        i = int(r["request_id"][1:])
        if "error" not in r:
            assert r["tokens"] == expected[i][: new_tokens[i]], r["request_id"]
    return sorted(records, key=lambda r: int(r["request_id"][1:])), pool


PROMPTS = [list(range(10 + 7 * i, 17 + 7 * i + i)) for i in range(6)]


@pytest.mark.slow
def test_preempted_requests_are_recomputed() -> None:
    records, pool = run(PROMPTS, [12, 9, 14, 6, 11, 8], num_blocks=18, send_prompt=True)
    assert [r["request_id"] for r in records] == [f"r{i}" for i in range(6)]
    assert all("error" not in r for r in records)
    assert sum(r["preemptions"] for r in records) > 0
    assert pool.hit_blocks > 0, "no recompute found its prompt's blocks in the pool"


def test_preempted_requests_without_prompt_wait_with_their_blocks() -> None:
    records, _ = run(PROMPTS[:4], [10, 14, 14, 14], num_blocks=17, send_prompt=False)
    assert all("error" not in r for r in records)
    assert sum(r["preemptions"] for r in records) > 0


@pytest.mark.slow
@pytest.mark.parametrize("send_prompt", [False, True])
def test_only_a_request_that_cannot_be_recomputed_is_dropped(send_prompt: bool) -> None:
    """Two prompts of two full blocks in a pool of four: both need a third block at their first step."""
    records, _ = run([list(range(8)), list(range(50, 58))], [6, 6], num_blocks=4, send_prompt=send_prompt)
    if send_prompt:
        assert all("error" not in r for r in records)
        assert records[1]["preemptions"] >= 1
    else:
        assert "error" not in records[0]
        assert "no prompt to recompute" in records[1]["error"]
