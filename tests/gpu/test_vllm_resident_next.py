"""Resident mode on vLLM 0.31+ (skipped without CUDA or without vLLM 0.31 or later): vLLM's one KV backing is the
pool's arena through vLLM's own ``get_mem_pool_context`` hook, with no vLLM attribute replaced. In one run per block
size (16, 32) and dtype (bf16, fp16): two resident engines give a plain engine's greedy tokens, one request at a time,
for a prefix the other engine computed and for a prefill handed to the other engine; a second engine attaching while
the first serves leaves the first one's tokens unchanged (its cached blocks in the arena are not zeroed); no block
is copied.

The model, the engines, the greedy runs and the pool per setup are test_vllm_resident.py's.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

vllm = pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if tuple(int(x) for x in vllm.__version__.split(".")[:2]) < (0, 31):
    pytest.skip("vLLM before 0.31 has no get_mem_pool_context: test_vllm_resident.py", allow_module_level=True)

from kvpool.client import PoolClient  # noqa: E402
from kvpool.integrations.vllm.connector import counters  # noqa: E402
from kvpool.integrations.vllm.memory import kv_placement  # noqa: E402
from tests.conftest import PoolProcess  # noqa: E402
from tests.gpu.test_vllm_resident import engine, greedy, setup  # noqa: E402, F401


def layer_offsets(pool: PoolProcess) -> list[int]:
    """Where the arena's layer regions start, as the pool lays them out."""
    with PoolClient(pool.url, name="probe") as client:
        desc = client.descriptor()
    return [desc.layout.layer_region(desc.num_blocks, i)[0] for i in range(desc.layout.num_layers)]


def test_engines_on_vllm_s_hook_keep_kv_in_the_arena_give_plain_tokens_and_attach_without_zeroing(
    setup: tuple[Path, PoolProcess, int],  # noqa: F811 - test_vllm_resident.py's fixture, one per block size and dtype
) -> None:
    model, pool, bs = setup
    g = torch.Generator().manual_seed(3)
    prefixes = torch.randint(10, 30000, (4, 12 * bs), generator=g).tolist()
    first = [p + torch.randint(10, 30000, (bs + 3,), generator=g).tolist() for p in prefixes]
    second = [p + torch.randint(10, 30000, (bs + 5,), generator=g).tolist() for p in prefixes]
    handed = torch.randint(10, 30000, (4, 9 * bs + 7), generator=g).tolist()

    plain = engine(model, None, bs)
    want_first = [o.outputs[0].token_ids for o in greedy(plain, first)]
    want_second = [o.outputs[0].token_ids for o in greedy(plain, second)]  # hits its own prefix cache
    want_handed = [o.outputs[0].token_ids for o in greedy(plain, handed)]
    plain.llm_engine.engine_core.shutdown()
    del plain

    a = engine(model, pool.url, bs)
    assert [o.outputs[0].token_ids for o in greedy(a, first)] == want_first

    # b attaches while a serves its own cached prefixes from the arena: a zero fill would wipe them
    served: list[list] = []
    attached = threading.Event()

    def serve() -> None:
        while not attached.is_set():
            served.append([o.outputs[0].token_ids for o in greedy(a, first)])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        b = engine(model, pool.url, bs)
    finally:
        attached.set()
        thread.join(600)
    assert served and all(tokens == want_first for tokens in served)
    assert [o.outputs[0].token_ids for o in greedy(a, first)] == want_first, "b's attach changed a's cached KV"

    got = greedy(b, second)  # b finds a's prefixes in the pool: the same arena blocks, no copy
    assert [o.outputs[0].token_ids for o in got] == want_second
    prefill = greedy(a, handed, max_tokens=1, params=[{"do_remote_decode": True}] * len(handed))
    params = [o.kv_transfer_params for o in prefill]
    assert all(p and "kvpool_handoff" in p for p in params)
    assert [o.outputs[0].token_ids for o in greedy(b, handed, params=params)] == want_handed

    (count_a,), (count_b,) = a.collective_rpc(counters), b.collective_rpc(counters)
    assert count_a["copied_blocks"] == 0 and count_b["copied_blocks"] == 0
    assert count_b["installed_blocks"] >= 4 * 12 + 4 * 9
    for llm in (a, b):
        (where,) = llm.collective_rpc(kv_placement)
        assert where["replaced"] == [], "resident mode on vLLM 0.31+ replaces no vLLM attribute"
        assert None not in where["offsets"], "a KV cache of this engine is outside the arena"
        assert sorted(where["offsets"]) == layer_offsets(pool), "vLLM's KV cache is not the arena's layer regions"
        llm.llm_engine.engine_core.shutdown()
