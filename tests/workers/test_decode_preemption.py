"""The decode worker when the pool runs out of blocks: preempted requests are recomputed (or wait with their
blocks) and still produce the tokens of an unhurried run; only a request that can do neither is dropped."""

from __future__ import annotations

import time
from array import array

import pytest

from kvpool.client import Claim
from kvpool.errors import HandoffNotFound, PoolExhausted
from kvpool.protocol import LookupResponse
from workers.decode import DecodeWorker
from workers.kvcache import layout_for, private_kv_caches
from workers.model import LlamaConfig, LlamaModel
from workers.monolithic import greedy_generate
from workers.request import HandoffMeta
from workers.sequence import blocks_needed, greedy

CONFIG = LlamaConfig(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip
BS = 4


class TinyPool:
    """A pool's books (ref counts, parked handoffs) over few blocks, without a prefix cache."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks))
        self.refs: dict[int, int] = {}
        self.parked: list[Claim] = []

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise PoolExhausted(f"{n} blocks asked, {len(self.free_ids)} free")
        taken, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        self.refs.update(dict.fromkeys(taken, 1))
        return taken

    def free(self, ids: list[int]) -> int:
        for b in ids:
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
                self.free_ids.append(b)
        return len(ids)

    def lookup(self, token_ids: list[int]) -> LookupResponse:
        return LookupResponse(block_ids=[], num_tokens=0)

    def claim(self, request_id: str | None = None, timeout_s: float = 0.0) -> Claim:
        if not self.parked:
            raise HandoffNotFound("nothing parked")
        return self.parked.pop(0)

    def confirm(self) -> None:
        pass


def run(prompts: list[list[int]], new_tokens: list[int], num_blocks: int, send_prompt: bool) -> list[dict]:
    """Prefill every prompt into the pool, park it, and let a decode worker of batch 4 take them all."""
    model = LlamaModel.random(CONFIG, seed=3)
    caches = private_kv_caches(layout_for(CONFIG, BS, "float32"), num_blocks, fill=float("nan"))
    pool = TinyPool(num_blocks)
    for i, (prompt, n) in enumerate(zip(prompts, new_tokens, strict=True)):
        table = pool.alloc(blocks_needed(len(prompt), BS))
        first = greedy(model.prefill(prompt, table, 0, caches)[None])[0]
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
    assert sorted(pool.free_ids) == list(range(num_blocks))
    expected = greedy_generate(model, prompts, max(new_tokens), layout_for(CONFIG, BS, "float32"))
    for r in records:
        i = int(r["request_id"][1:])
        if "error" not in r:
            assert r["tokens"] == expected[i][: new_tokens[i]], r["request_id"]
    return sorted(records, key=lambda r: int(r["request_id"][1:]))


PROMPTS = [list(range(10 + 7 * i, 17 + 7 * i + i)) for i in range(6)]


def test_preempted_requests_are_recomputed() -> None:
    records = run(PROMPTS, [12, 9, 14, 6, 11, 8], num_blocks=18, send_prompt=True)
    assert [r["request_id"] for r in records] == [f"r{i}" for i in range(6)]
    assert all("error" not in r for r in records)
    assert sum(r["preemptions"] for r in records) > 0


def test_preempted_requests_without_prompt_wait_with_their_blocks() -> None:
    records = run(PROMPTS[:4], [10, 14, 14, 14], num_blocks=17, send_prompt=False)
    assert all("error" not in r for r in records)
    assert sum(r["preemptions"] for r in records) > 0


@pytest.mark.parametrize("send_prompt", [False, True])
def test_only_a_request_that_cannot_be_recomputed_is_dropped(send_prompt: bool) -> None:
    """Two prompts of two full blocks in a pool of four: both need a third block at their first step."""
    records = run([list(range(8)), list(range(50, 58))], [6, 6], num_blocks=4, send_prompt=send_prompt)
    if send_prompt:
        assert all("error" not in r for r in records)
        assert records[1]["preemptions"] >= 1
    else:
        assert "error" not in records[0]
        assert "no prompt to recompute" in records[1]["error"]
