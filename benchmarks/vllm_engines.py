"""vLLM engines with and without the kvpool connector, on one GPU: greedy tokens and TTFT/TPOT, printed and saved.

    python -m kvpool.benchmarks.vllm_engines --out results/        (needs vLLM, a CUDA GPU and about 50 GiB)

The workload of ``benchmarks e2e``: a random model shaped like Llama-3.2-1B (bf16, built here with
``save_pretrained``), token-id prompts, 32 requests x 1024 tokens -> 64 new, greedy, all at t0; TRITON_ATTN.
Each round uses fresh prompts: 32 prefixes of 768 tokens, prompt A = prefix + 256 tokens, prompt B = prefix +
256 other tokens.

1. Plain engine, no connector (its prefix cache emptied between runs): B cold; A then B (B hits vLLM's own
   prefix cache); for the prefill/decode prompts P, P cold and P once more after a 1-token prefill of P.
2. Two engines with the connector, one pool: A on engine 1, then B on engine 2 (its prefix comes from the pool);
   P prefilled on engine 1 (1 token, handed off) and decoded on engine 2.
Greedy tokens of 2 are compared with 1's: against the same cached-prefix path of vLLM, and against cold.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvpool.benchmarks.vllm_drive import outcome
from kvpool.client import PoolClient
from kvpool.server.launch import spawn

N_REQ, PROMPT, PREFIX, NEW, BS = 32, 1024, 768, 64, 16
SINGLES = 8  # requests served one at a time for the token comparison: no batch composition in play
LLAMA_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip


def build_model(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_1B, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def prompts(seed: int) -> dict[str, list[list[int]]]:
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[list[int]]:
        return torch.randint(10, 128000, (N_REQ, n), generator=g).tolist()

    pre, sa, sb = ids(PREFIX), ids(PROMPT - PREFIX), ids(PROMPT - PREFIX)
    return {
        "A": [p + s for p, s in zip(pre, sa, strict=True)],
        "B": [p + s for p, s in zip(pre, sb, strict=True)],
        "P": ids(PROMPT),
    }


def engine(
    model: Path,
    pool_url: str | None,
    util: float,
    extra: dict | None = None,
    module: str = "kvpool.integrations.vllm",
    eager: bool = True,
    transfer: Any = None,
) -> Any:
    """An engine of the workload; with the kvpool connector when ``pool_url`` is given, or ``transfer`` (another
    connector's ``KVTransferConfig``); CUDA graphs unless ``eager``."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {"kv_transfer_config": transfer} if transfer is not None else {}
    if pool_url:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvpoolConnector", kv_connector_module_path=module, kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"url": pool_url, "reserve_blocks": 4096, **(extra or {})},
        )  # fmt: skip
    return LLM(
        model=str(model), skip_tokenizer_init=True, attention_backend="TRITON_ATTN", gpu_memory_utilization=util,
        enable_prefix_caching=True, max_num_batched_tokens=16384, block_size=BS, max_model_len=2048, seed=0,
        enforce_eager=eager, disable_log_stats=False, **kw,
    )  # fmt: skip


def run(llm: Any, batch: list[list[int]], max_tokens: int = NEW, params: list[dict] | None = None) -> dict:
    """One ``generate`` of the whole batch: tokens, TTFT and TPOT per request (vLLM's own timestamps)."""
    from vllm import SamplingParams

    sps = [
        SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args={"kv_transfer_params": p} if p else None
        )
        for p in (params or [None] * len(batch))
    ]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], sps, use_tqdm=False)
    return outcome(outs, time.perf_counter() - t0)


def p50(xs: list[float]) -> float:
    return round(statistics.median(xs), 2) if xs else float("nan")


def close(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # best effort: the process is ending anyway
        print(f"shutdown: {exc}")
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def plain_phase(model: Path, rounds: list[dict], out: dict) -> None:
    llm = engine(model, None, 0.3)
    warm = prompts(999)
    run(llm, warm["A"]), run(llm, warm["B"])
    for r, ps in enumerate(rounds):
        res: dict[str, Any] = {}
        llm.reset_prefix_cache()
        res["B_cold"] = run(llm, ps["B"])
        llm.reset_prefix_cache()
        run(llm, ps["A"])
        res["B_own_cache"] = run(llm, ps["B"])
        llm.reset_prefix_cache()
        run(llm, ps["A"])
        res["B_own_cache_again"] = run(llm, ps["B"])  # how far vLLM's own batched runs agree with each other
        llm.reset_prefix_cache()
        res["P_cold"] = run(llm, ps["P"])
        llm.reset_prefix_cache()
        run(llm, ps["P"], max_tokens=1)
        res["P_own_cache"] = run(llm, ps["P"])
        out["plain"].append(res)
        print(f"plain round {r}: B cold TTFT p50 {p50(res['B_cold']['ttft_ms'])} ms, own cache "
              f"{p50(res['B_own_cache']['ttft_ms'])} ms", flush=True)  # fmt: skip
    singles = prompts(500)
    for i in range(SINGLES):
        llm.reset_prefix_cache()
        run(llm, singles["A"][i : i + 1])
        out["plain_single"].setdefault("B", []).append(run(llm, singles["B"][i : i + 1])["tokens"][0])
        llm.reset_prefix_cache()
        out["plain_single"].setdefault("B_cold", []).append(run(llm, singles["B"][i : i + 1])["tokens"][0])
        llm.reset_prefix_cache()
        run(llm, singles["P"][i : i + 1], max_tokens=1)
        out["plain_single"].setdefault("P", []).append(run(llm, singles["P"][i : i + 1])["tokens"][0])
    close(llm)


def pool_phase(model: Path, url: str, rounds: list[dict], out: dict) -> None:
    with PoolClient(url, name="bench") as probe:
        e1 = engine(model, url, 0.25)
        e2 = engine(model, url, 0.25)
        warm = prompts(998)
        run(e1, warm["A"]), run(e2, warm["B"])
        for r, ps in enumerate(rounds):
            res: dict[str, Any] = {}
            s0 = probe.stats()
            res["A_engine1"] = run(e1, ps["A"])
            s1 = probe.stats()
            res["B_engine2"] = run(e2, ps["B"])
            s2 = probe.stats()
            c0, c1, c2 = (x["counters"] for x in (s0, s1, s2))
            res["pool"] = {"committed_by_A": c1["committed_blocks"] - c0["committed_blocks"],
                           "committed_by_B": c2["committed_blocks"] - c1["committed_blocks"],
                           "hit_blocks_B": c2["hit_blocks"] - c1["hit_blocks"]}  # fmt: skip
            pre = run(e1, ps["P"], max_tokens=1, params=[{"do_remote_decode": True}] * N_REQ)
            res["P_prefill"] = pre
            res["P_decode"] = run(e2, ps["P"], params=pre["kv_transfer_params"])
            out["pool"].append(res)
            print(f"pool round {r}: B TTFT p50 {p50(res['B_engine2']['ttft_ms'])} ms, pool {res['pool']}", flush=True)
        singles = prompts(500)
        for i in range(SINGLES):
            run(e1, singles["A"][i : i + 1])
            out["pool_single"].setdefault("B", []).append(run(e2, singles["B"][i : i + 1])["tokens"][0])
            pre = run(e1, singles["P"][i : i + 1], max_tokens=1, params=[{"do_remote_decode": True}])
            dec = run(e2, singles["P"][i : i + 1], params=pre["kv_transfer_params"])
            out["pool_single"].setdefault("P", []).append(dec["tokens"][0])
        out["pool_stats"] = probe.stats()
        close(e1)
        close(e2)


def summary(out: dict) -> dict:
    def same(a: list, b: list) -> int:
        return sum(x == y for x, y in zip(a, b, strict=True))

    s: dict[str, Any] = {"rounds": len(out["pool"])}
    pl, po = out["plain"], out["pool"]
    cat = lambda rs, k, f: [x for r in rs for x in r[k][f]]  # noqa: E731
    s["ttft_p50_ms"] = {
        "B_cold_plain": p50(cat(pl, "B_cold", "ttft_ms")),
        "B_own_cache_plain": p50(cat(pl, "B_own_cache", "ttft_ms")),
        "B_from_pool": p50(cat(po, "B_engine2", "ttft_ms")),
        "P_cold_plain": p50(cat(pl, "P_cold", "ttft_ms")),
        "P_prefill_engine1": p50(cat(po, "P_prefill", "ttft_ms")),
        "P_decode_engine2": p50(cat(po, "P_decode", "ttft_ms")),
    }
    s["ttft_ratio_pool_vs_cold"] = round(s["ttft_p50_ms"]["B_from_pool"] / s["ttft_p50_ms"]["B_cold_plain"], 3)
    s["tpot_p50_ms"] = {k: p50(cat(rs, f, "tpot_ms")) for k, rs, f in
                        [("B_cold_plain", pl, "B_cold"), ("B_from_pool", po, "B_engine2"),
                         ("P_decode_engine2", po, "P_decode")]}  # fmt: skip
    n = N_REQ * len(po)

    def agree(mine: str, theirs: str, rs: list = po) -> str:
        return f"{sum(same(a[mine]['tokens'], b[theirs]['tokens']) for a, b in zip(rs, pl, strict=True))}/{n}"

    s["identical_requests"] = {
        "B_pool_vs_own_cache": agree("B_engine2", "B_own_cache"),
        "B_pool_vs_cold": agree("B_engine2", "B_cold"),
        "B_own_cache_vs_cold": agree("B_own_cache", "B_cold", pl),
        "B_own_cache_vs_own_cache_again": agree("B_own_cache", "B_own_cache_again", pl),
        "P_handoff_vs_own_cache": agree("P_decode", "P_own_cache"),
        "P_handoff_vs_cold": agree("P_decode", "P_cold"),
        "P_own_cache_vs_cold": agree("P_own_cache", "P_cold", pl),
    }
    ps, ss = out["plain_single"], out["pool_single"]
    s["identical_single_requests"] = {
        "B_pool_vs_own_cache": f"{same(ss['B'], ps['B'])}/{len(ps['B'])}",
        "P_handoff_vs_own_cache": f"{same(ss['P'], ps['P'])}/{len(ps['P'])}",
        "B_own_cache_vs_cold": f"{same(ps['B'], ps['B_cold'])}/{len(ps['B'])}",
    }
    s["pool_per_round"] = [r["pool"] for r in po]
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pool-blocks", type=int, default=20480)
    ap.add_argument("--skip-plain", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvp-vllm-"))
    model = work / "llama-1b-random"
    t = time.perf_counter()
    build_model(model)
    print(f"model built in {time.perf_counter() - t:.1f}s on {torch.cuda.get_device_name()}", flush=True)
    rounds = [prompts(r) for r in range(args.rounds)]
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "plain": [], "pool": [],
                           "plain_single": {}, "pool_single": {}}  # fmt: skip
    if not args.skip_plain:
        plain_phase(model, rounds, out)
    sock = work / "kvpool.sock"
    flags = ["--socket", str(sock), "--port", "0", "--backend", "cuda", "--num-blocks", str(args.pool_blocks),
             "--num-layers", "16", "--num-kv-heads", "8", "--head-dim", "64", "--block-size", str(BS),
             "--dtype", "bf16", "--model", str(model), "--log-level", "warning"]  # fmt: skip
    pool = spawn(["kvpool", "serve", *flags], socket=sock, port=0, log=args.out / "pool.log", timeout_s=120)
    try:
        pool_phase(model, f"unix://{sock}", rounds, out)
    finally:
        pool.stop()
    (args.out / "raw.json").write_text(json.dumps(out))
    if out["plain"]:
        s = summary(out)
        (args.out / "summary.json").write_text(json.dumps(s, indent=1))
        print(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
