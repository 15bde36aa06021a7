"""Resident mode on a GPU with vLLM (skipped without CUDA or vLLM): two engines whose KV caches are the pool's
arena give the same greedy tokens as a plain engine with its own prefix cache, for prompts whose prefix the other
engine computed and for a prefill handed from one engine to the other; and no block is copied.

A random Llama-shaped model (4 layers) keeps it short; ``kvpool bench vllm`` measures the full-size one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

vllm = pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")

from kvpool.client import PoolClient  # noqa: E402
from kvpool.integrations.vllm.connector import counters  # noqa: E402
from tests.conftest import PoolProcess, start_pool  # noqa: E402

BS = 16
SMALL = dict(
    hidden_size=1024, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
    head_dim=64, vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip
NUM_BLOCKS = 4096


def build_model(path: Path, dtype: torch.dtype) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SMALL, torch_dtype=str(dtype).removeprefix("torch."))).to(dtype)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def engine(model: Path, pool_url: str | None, block_size: int, mode: str = "resident") -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if pool_url is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config={"url": pool_url, "mode": mode},
        )  # fmt: skip
        kw["num_gpu_blocks_override"] = NUM_BLOCKS
    return LLM(
        model=str(model), skip_tokenizer_init=True, attention_backend="TRITON_ATTN", gpu_memory_utilization=0.12,
        enable_prefix_caching=True, block_size=block_size, max_model_len=2048, seed=0, enforce_eager=True, **kw,
    )  # fmt: skip


def greedy(llm: Any, prompts: list[list[int]], max_tokens: int = 16, params: list[dict] | None = None) -> list:
    from vllm import SamplingParams

    outs = []
    for i, p in enumerate(prompts):  # one at a time: no batch composition in play
        extra = {"kv_transfer_params": params[i]} if params else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
        (out,) = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)
        outs.append(out)
    return outs


COMBOS = [(16, torch.bfloat16), (16, torch.float16), (32, torch.bfloat16), (32, torch.float16)]


@pytest.fixture(scope="module", params=COMBOS, ids=["bs16-bf16", "bs16-fp16", "bs32-bf16", "bs32-fp16"])
def setup(request, tmp_path_factory) -> Iterator[tuple[Path, PoolProcess, int]]:
    block_size, dtype = request.param
    torch.cuda.init()  # the LLMs' engine cores start by spawn, not by a fork of a process without CUDA
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(counters) sends a function
    model = tmp_path_factory.mktemp("model")
    build_model(model, dtype)
    pool = start_pool(
        "--backend", "cuda", "--num-layers", "4", "--num-kv-heads", "8", "--head-dim", "64", "--block-size",
        str(block_size), "--dtype", str(dtype).removeprefix("torch."), "--order", "kv_packed", "--num-blocks",
        str(NUM_BLOCKS), "--slabs", "--slab-regions", "8", "--slab-max-blocks", str(NUM_BLOCKS),
    )  # fmt: skip
    yield model, pool, block_size
    pool.stop()


def test_resident_engines_give_the_plain_engine_s_tokens_and_copy_nothing(setup) -> None:
    model, pool, bs = setup
    g = torch.Generator().manual_seed(1)
    prefixes = torch.randint(10, 30000, (4, 12 * bs), generator=g).tolist()
    first = [p + torch.randint(10, 30000, (bs + 3,), generator=g).tolist() for p in prefixes]
    second = [p + torch.randint(10, 30000, (bs + 5,), generator=g).tolist() for p in prefixes]
    handed = torch.randint(10, 30000, (4, 9 * bs + 7), generator=g).tolist()

    plain = engine(model, None, bs)
    greedy(plain, first)
    want_second = [o.outputs[0].token_ids for o in greedy(plain, second)]  # hits its own prefix cache
    want_handed = [o.outputs[0].token_ids for o in greedy(plain, handed)]
    plain.llm_engine.engine_core.shutdown()
    del plain

    a, b = engine(model, pool.url, bs), engine(model, pool.url, bs)
    greedy(a, first)  # engine a computes the prefixes
    got = greedy(b, second)  # engine b finds them in the pool: the same arena blocks, no copy
    assert [o.outputs[0].token_ids for o in got] == want_second
    prefill = greedy(a, handed, max_tokens=1, params=[{"do_remote_decode": True}] * len(handed))
    params = [o.kv_transfer_params for o in prefill]
    assert all(p and "kvpool_handoff" in p for p in params)
    decoded = greedy(b, handed, params=params)
    assert [o.outputs[0].token_ids for o in decoded] == want_handed
    (count_b,) = b.collective_rpc(counters)
    (count_a,) = a.collective_rpc(counters)
    assert count_b["installed_blocks"] >= 4 * 12 + 4 * 9 and count_b["copied_blocks"] == 0
    assert count_a["parked_requests"] == 4 and count_a["copied_blocks"] == 0
    for llm in (a, b):
        llm.llm_engine.engine_core.shutdown()
    with PoolClient(pool.url, name="probe") as c:
        s = c.stats()
    assert s["free"] + s["in_use"] + s["cached"] == s["num_blocks"]


def test_a_killed_engine_s_blocks_come_back_and_the_other_serves_on(tmp_path_factory) -> None:
    """Engine a is killed (SIGKILL of its engine core) in the middle of a burst: its sessions' blocks are back in
    the pool within the lease's time-to-live + 1 s, the books balance, and engine b's greedy tokens are what they
    were before."""
    import signal
    import threading
    import time

    torch.cuda.init()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    model = tmp_path_factory.mktemp("model-kill")
    build_model(model, torch.bfloat16)
    ttl = 3.0
    pool = start_pool(
        "--backend", "cuda", "--num-layers", "4", "--num-kv-heads", "8", "--head-dim", "64", "--block-size", "16",
        "--dtype", "bfloat16", "--order", "kv_packed", "--num-blocks", str(NUM_BLOCKS), "--slabs", "--slab-regions",
        "8", "--slab-max-blocks", str(NUM_BLOCKS), "--lease-ttl-s", str(ttl),
    )  # fmt: skip
    try:
        g = torch.Generator().manual_seed(2)
        mine = torch.randint(10, 30000, (4, 20 * 16 + 5), generator=g).tolist()
        burst = torch.randint(10, 30000, (64, 40 * 16), generator=g).tolist()
        a, b = engine(model, pool.url, 16), engine(model, pool.url, 16)
        before = [o.outputs[0].token_ids for o in greedy(b, mine)]
        probe = PoolClient(pool.url, name="probe")
        sessions = probe.stats()["sessions"]
        died: list[BaseException] = []

        def doomed() -> None:
            try:
                greedy(a, burst, max_tokens=64)
            except BaseException as exc:  # its engine core is killed under it
                died.append(exc)

        # a daemon: its generate() may never return once the engine core under it is gone, and the interpreter
        # would wait for it at exit (the test passed, then the process hung)
        thread = threading.Thread(target=doomed, daemon=True)
        thread.start()
        time.sleep(1.0)
        os.kill(a.llm_engine.engine_core.resources.engine_manager.processes[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        while probe.stats()["sessions"] > sessions - 2:  # a's two sessions: its scheduler's and its worker's
            assert time.monotonic() - killed < ttl + 1.0, "the killed engine's sessions outlived their lease + 1 s"
            time.sleep(0.05)
        back_s = time.monotonic() - killed
        thread.join(5)
        after = [o.outputs[0].token_ids for o in greedy(b, mine)]
        assert after == before, "the engine that lived gives the same tokens"
        s = probe.stats()
        assert s["free"] + s["in_use"] + s["cached"] == s["num_blocks"]
        print(f"blocks back {back_s:.2f} s after the kill (lease {ttl} s); pool {s['free']} free, {s['in_use']} in use")
        probe.close()
        b.llm_engine.engine_core.shutdown()
    finally:
        pool.stop()
