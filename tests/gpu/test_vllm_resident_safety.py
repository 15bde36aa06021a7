"""Resident mode left running as a serving engineer runs it (issue 45), on a GPU with vLLM (skipped without CUDA or
vLLM): LoRA, salted and plain requests through two resident engines give vLLM's own cache's greedy tokens; a burst
that needs twice the arena finishes on both engines; an engine stopped past its lease never writes a block the other
was given; an engine killed mid-burst leaves its prefixes hits for the other and warm for its restart.

A random Llama-shaped model and a random LoRA adapter keep it short. Figures are printed (``-s``), not asserted
beyond the issue's bounds.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

vllm = pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]')")

from kvpool.client import PoolClient  # noqa: E402
from tests.conftest import PoolProcess, start_pool  # noqa: E402
from tests.gpu.test_vllm_resident import SMALL, build_model  # noqa: E402

BS = 16
RANK = 8


def lora_adapter(path: Path) -> Path:
    """A random LoRA adapter on the attention projections, large enough to change every layer's K and V."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    hidden, kv = SMALL["hidden_size"], SMALL["num_key_value_heads"] * SMALL["head_dim"]
    weights = {}
    for layer in range(SMALL["num_hidden_layers"]):
        for name, out in (("q_proj", hidden), ("k_proj", kv), ("v_proj", kv)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{key}.lora_A.weight"] = torch.randn(RANK, hidden, generator=g) * 0.05
            weights[f"{key}.lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.5
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": ["q_proj", "k_proj", "v_proj"],
              "bias": "none", "task_type": "CAUSAL_LM", "fan_in_fan_out": False, "lora_dropout": 0.0}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def engine(model: Path, pool_url: str | None, num_blocks: int, lora: bool = False) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if pool_url is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"url": pool_url, "mode": "resident", "slab_blocks": 64},
        )  # fmt: skip
    if lora:
        kw.update(enable_lora=True, max_lora_rank=RANK, max_loras=1)
    return LLM(
        model=str(model), skip_tokenizer_init=True, attention_backend="TRITON_ATTN", gpu_memory_utilization=0.12,
        enable_prefix_caching=True, block_size=BS, max_model_len=2048, seed=0, enforce_eager=True,
        num_gpu_blocks_override=num_blocks, **kw,
    )  # fmt: skip


def greedy(llm: Any, prompts: list[dict], max_tokens: int = 16, lora: Any = None, together: bool = False) -> list:
    """Greedy tokens of each prompt, one at a time (no batch composition in play) unless ``together``."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    if together:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, lora_request=lora, use_tqdm=False)]
    return [llm.generate([p], sp, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def stop(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()


def core_pid(llm: Any) -> int:
    return int(llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid)


def randoms(seed: int, n: int, length: int) -> list[list[int]]:
    return torch.randint(10, 30000, (n, length), generator=torch.Generator().manual_seed(seed)).tolist()


def pool_flags(num_blocks: int, *extra: str) -> list[str]:
    return ["--backend", "cuda", "--num-layers", "4", "--num-kv-heads", "8", "--head-dim", "64", "--block-size",
            str(BS), "--dtype", "bfloat16", "--order", "kv_packed", "--num-blocks", str(num_blocks), "--slabs",
            "--slab-regions", "8", "--slab-max-blocks", str(num_blocks), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.cuda.init()  # the LLMs' engine cores start by spawn, not by a fork of a process without CUDA
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    path = tmp_path_factory.mktemp("model")
    build_model(path, torch.bfloat16)
    return path


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    proc = start_pool(*pool_flags(4096))
    yield proc
    proc.stop()


def test_lora_salted_and_plain_requests_through_two_resident_engines_give_the_own_cache_s_tokens(
    model: Path, pool: PoolProcess, tmp_path: Path
) -> None:
    """Each kind's prefix is computed by engine a, then asked for by engine b: b must give what an engine with its
    own cache gives, so a LoRA or salted request never starts from another identity's KV."""
    from vllm.lora.request import LoRARequest

    adapter = LoRARequest("random", 1, str(lora_adapter(tmp_path / "adapter")))
    prefixes = randoms(1, 3, 12 * BS)
    tails = randoms(2, 3, BS + 3)
    first = [{"prompt_token_ids": p + t} for p, t in zip(prefixes, tails, strict=True)]
    second = [{"prompt_token_ids": p + t[::-1]} for p, t in zip(prefixes, tails, strict=True)]
    salted = [{**p, "cache_salt": "tenant-b"} for p in second]
    kinds = {"plain": (second, None), "lora": (second, adapter), "salted": (salted, None)}

    plain = engine(model, None, 4096, lora=True)
    want = {}
    for kind, (prompts, lora) in kinds.items():
        greedy(plain, first, lora=lora)  # its own cache holds the first round's prefixes, as the pool will
        want[kind] = greedy(plain, prompts, lora=lora)
    stop(plain)

    a, b = engine(model, pool.url, 4096, lora=True), engine(model, pool.url, 4096, lora=True)
    try:
        greedy(a, first)  # base-model KV of every prefix in the pool: what a wrong hit would hand the others
        got = {}
        for kind, (prompts, lora) in kinds.items():
            if kind != "plain":
                greedy(a, [{**f, **({"cache_salt": "tenant-b"} if kind == "salted" else {})} for f in first],
                       lora=lora)  # fmt: skip
            got[kind] = greedy(b, prompts, lora=lora)
        for kind in kinds:
            assert got[kind] == want[kind], f"{kind} requests: resident tokens differ from the own cache's"
    finally:
        stop(a)
        stop(b)


def test_a_burst_that_needs_twice_the_arena_finishes_on_both_engines(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """512 blocks, two engines, 32 requests each of 16 blocks: vLLM preempts and waits as with its own cache. With
    batch-invariant kernels, so that which requests share a step (preemptions differ between the engines) does not
    change the bf16 results."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    pool = start_pool(*pool_flags(512))
    a = b = None
    try:
        a, b = engine(model, pool.url, 512), engine(model, pool.url, 512)
        prompts = [{"prompt_token_ids": p} for p in randoms(3, 32, 15 * BS)]
        outs: dict[str, list] = {}
        errors: list[BaseException] = []

        def run(name: str, llm: Any) -> None:
            try:
                outs[name] = greedy(llm, prompts, max_tokens=BS, together=True)
            except BaseException as exc:
                errors.append(exc)

        began = time.monotonic()
        threads = [threading.Thread(target=run, args=(n, e)) for n, e in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, f"an engine failed: {errors!r}"
        assert all(len(o) == BS for o in outs["a"] + outs["b"]), "every request finished"
        same = sum(x == y for x, y in zip(outs["a"], outs["b"], strict=True))
        print(f"burst of 2x32 over 2x the arena: {time.monotonic() - began:.1f} s, {same}/32 identical across engines")
        assert same == len(prompts), "the two engines' tokens differ"
        with PoolClient(pool.url, name="probe") as c:
            s = c.stats()
        assert s["free"] + s["in_use"] + s["cached"] + s.get("quarantined", 0) == s["num_blocks"]
    finally:
        for llm in (a, b):
            if llm is not None:
                stop(llm)
        pool.stop()


def test_an_engine_stopped_past_its_lease_never_writes_a_block_the_other_was_given(model: Path) -> None:
    """Engine a is SIGSTOPped mid-burst past its 2 s lease while engine b fills the arena, then SIGCONTed: b's tokens
    are what they were before, and the pool says what it held back."""
    pool = start_pool(*pool_flags(1024, "--lease-ttl-s", "2"))
    a = b = None
    try:
        a, b = engine(model, pool.url, 1024), engine(model, pool.url, 1024)
        mine = [{"prompt_token_ids": p} for p in randoms(4, 8, 20 * BS + 5)]
        before = greedy(b, mine)
        burst = [{"prompt_token_ids": p} for p in randoms(5, 64, 30 * BS)]
        thread = threading.Thread(target=lambda: _quietly(greedy, a, burst, 64, None, True), daemon=True)
        thread.start()
        time.sleep(1.5)
        pid = core_pid(a)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(5.0)  # past the lease: the pool takes a's sessions, but not the blocks a could still write
        fill = [{"prompt_token_ids": p} for p in randoms(6, 48, 30 * BS)]
        filled = threading.Thread(target=lambda: greedy(b, fill, 8, None, True), daemon=True)
        filled.start()  # b takes all the room there is, and waits for the rest
        time.sleep(3.0)
        with PoolClient(pool.url, name="probe") as c:
            stats = c.stats()
        os.kill(pid, signal.SIGCONT)  # a runs on: it must stop before it writes, and then its blocks come back
        filled.join(120)
        assert not filled.is_alive(), "engine b never got the stopped engine's blocks back"
        after = greedy(b, mine)
        assert after == before, "engine b's tokens changed: a block it was given was written by engine a"
        print(f"stopped engine: the pool's books while it was stopped: {json.dumps(_fence(stats))}")
    finally:
        for llm in (a, b):
            if llm is not None:
                _quietly(stop, llm)
        pool.stop()


def test_a_killed_engine_s_prefixes_stay_hits_and_its_restart_is_warm(model: Path) -> None:
    """Engine a computes prefixes and is SIGKILLed mid-burst: engine b's hits on them are what they were (at least
    95%), and a restarted engine's TTFT on them is at most 1.1x a warm engine's."""
    pool = start_pool(*pool_flags(4096, "--lease-ttl-s", "3"))
    a = b = None
    try:
        a, b = engine(model, pool.url, 4096), engine(model, pool.url, 4096)
        prefixes = randoms(7, 16, 40 * BS)
        hot = [{"prompt_token_ids": p + t} for p, t in zip(prefixes, randoms(8, 16, 9), strict=True)]
        greedy(a, [{"prompt_token_ids": p + [11] * 5} for p in prefixes])  # a computes every prefix
        warm = _ttft(a, hot)
        hits_before = _hit_tokens(b, hot)
        burst = [{"prompt_token_ids": p} for p in randoms(9, 64, 30 * BS)]
        thread = threading.Thread(target=lambda: _quietly(greedy, a, burst, 64, None, True), daemon=True)
        thread.start()
        time.sleep(1.5)
        os.kill(core_pid(a), signal.SIGKILL)
        time.sleep(4.0)  # its sessions lapse, its process is gone: its blocks are back, its prefixes stay indexed
        hits_after = _hit_tokens(b, hot)
        _quietly(stop, a)
        a = engine(model, pool.url, 4096)
        restarted = _ttft(a, hot)
        ratio = statistics.median(restarted) / statistics.median(warm)
        kept = hits_after / max(1, hits_before)
        print(f"killed engine: b's hit tokens {hits_after} after vs {hits_before} before ({kept:.2%}); restarted "
              f"TTFT p50 {statistics.median(restarted) * 1e3:.1f} ms vs warm {statistics.median(warm) * 1e3:.1f} ms "
              f"({ratio:.2f}x)")  # fmt: skip
        assert kept >= 0.95
        assert ratio <= 1.1
    finally:
        for llm in (a, b):
            if llm is not None:
                _quietly(stop, llm)
        pool.stop()


def _quietly(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except BaseException:
        return None


def _ttft(llm: Any, prompts: list[dict]) -> list[float]:
    """Each prompt's time to its first token, one at a time (a 1-token generate: prefill and one sample)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    out = []
    for p in prompts:
        began = time.perf_counter()
        llm.generate([p], sp, use_tqdm=False)
        out.append(time.perf_counter() - began)
    return out


def _hit_tokens(llm: Any, prompts: list[dict]) -> int:
    """Prompt tokens the engine found computed (vLLM's own count of each request's cached tokens)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return sum(int(o.num_cached_tokens or 0) for p in prompts for o in llm.generate([p], sp, use_tqdm=False))


def _fence(stats: dict[str, Any]) -> dict[str, Any]:
    keys = ("free", "in_use", "cached", "quarantined", "sessions")
    out = {k: stats[k] for k in keys if k in stats}
    out.update({k: v for k, v in stats.get("counters", {}).items() if "quarantin" in k or "lapse" in k or "kill" in k})
    return out
