"""What the connector adds to vLLM's ``schedule()`` in a burst, measured with vLLM's own scheduler on the CPU.

    python -m kvpool.benchmarks.vllm_schedule [--requests 32] [--rounds 4] [--json out.json]

Needs vLLM (``pip install "kvpool[vllm]"``), no GPU: the scheduler is vLLM's ``v1`` ``Scheduler`` with its KV cache
manager, and no model runs. Each round, ``--requests`` prompts of 1,024 tokens arrive at once and share a
768-token prefix with earlier prompts. One scheduler holds that prefix in vLLM's own prefix cache. The other has
the kvpool connector loaded, and the pool holds the prefix; its lookups are answered before it schedules, as
lookups on arrival are. The harness times the scheduler step that takes the burst in, and, inside it, the
connector's three scheduler-side calls. That step is on the critical path of every request in it: the forward
starts after it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvpool.client import PoolClient
from kvpool.server.launch import spawn

BS, PROMPT, SHARED, LAYERS, HEADS, HEAD_DIM = 16, 1024, 768, 2, 2, 16
CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta")


def model_dir(work: Path) -> Path:
    """A Llama config small enough for the CPU (only the scheduler reads it: no weights)."""
    from transformers import LlamaConfig

    d = work / "model"
    LlamaConfig(
        architectures=["LlamaForCausalLM"], hidden_size=HEADS * 2 * HEAD_DIM, intermediate_size=128,
        num_attention_heads=HEADS * 2, num_key_value_heads=HEADS, num_hidden_layers=LAYERS, head_dim=HEAD_DIM,
        vocab_size=128_256, max_position_embeddings=4096, torch_dtype="float32", tie_word_embeddings=True,
    ).save_pretrained(d)  # fmt: skip
    return d


def scheduler(model: Path, url: str | None, num_blocks: int, batch_tokens: int) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    transfer = None
    if url is not None:
        transfer = KVTransferConfig(
            kv_connector="KvpoolConnector", kv_connector_module_path="kvpool.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config={"url": url, "reserve_blocks": 0},
        )  # fmt: skip
    config = VllmConfig(
        model_config=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=4096),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=256, max_num_batched_tokens=batch_tokens, max_model_len=4096, is_encoder_decoder=False
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=transfer,
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(config, kv, StructuredOutputManager(config), block_size=BS)


def timing(spent: dict[str, float]) -> Callable[[str], None]:
    """Wraps a connector call so that ``spent`` sums its milliseconds."""
    from kvpool.integrations.vllm.connector import KvpoolConnector

    def wrap(name: str) -> None:
        original = getattr(KvpoolConnector, name)

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + (time.perf_counter() - t0) * 1e3

        setattr(KvpoolConnector, name, timed)

    return wrap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32, help="prompts in the burst")
    ap.add_argument("--rounds", type=int, default=4, help="bursts, each on fresh prompts (the first is warm-up)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)

    hasher = get_request_block_hasher(BS, hash_fn)

    def request(req_id: str, prompt: list[int]) -> Request:
        return Request(req_id, prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher)

    work = Path(tempfile.mkdtemp(prefix="kvb-schedule-"))
    sock = work / "pool.sock"
    need = PROMPT // BS * args.requests * (args.rounds + 1)  # vLLM frees an aborted request's blocks only later
    flags = ["kvpool", "serve", "--socket", str(sock), "--port", "0", "--num-blocks", str(4 * need),
             "--num-layers", str(LAYERS), "--num-kv-heads", str(HEADS), "--head-dim", str(HEAD_DIM),
             "--block-size", str(BS), "--dtype", "float32", "--log-level", "warning"]  # fmt: skip
    pool = spawn(flags, socket=sock, port=0, log=work / "pool.log", timeout_s=60)
    spent: dict[str, float] = {}
    wrap = timing(spent)
    for name in CALLS:
        wrap(name)
    rows: dict[str, list[float]] = {"own prefix cache": [], "kvpool connector": []}
    calls: dict[str, list[float]] = {name: [] for name in CALLS}
    rng = random.Random(0)
    try:
        url = f"unix://{sock}"
        model = model_dir(work)
        batch_tokens = args.requests * PROMPT
        own, pooled = scheduler(model, None, need, batch_tokens), scheduler(model, url, need, batch_tokens)
        with PoolClient(url, name="probe") as probe:
            for r in range(args.rounds):
                prompts = [[rng.randrange(128_000) for _ in range(PROMPT)] for _ in range(args.requests)]
                for i, p in enumerate(prompts):
                    probe.commit(probe.alloc(SHARED // BS), p[:SHARED], release=True)
                    own.add_request(request(f"a{r}-{i}", p[:SHARED] + [1] * BS))
                own.schedule()  # the prefixes, computed by the plain engine, then finished: cached
                own.finish_requests([q.request_id for q in list(own.running)], RequestStatus.FINISHED_ABORTED)
                for i, p in enumerate(prompts):
                    own.add_request(request(f"b{r}-{i}", p))
                    pooled.add_request(request(f"b{r}-{i}", p))
                pooled.connector._sched.drain()  # lookups answered, as on arrival
                for name, s in (("own prefix cache", own), ("kvpool connector", pooled)):
                    spent.clear()
                    t0 = time.perf_counter()
                    out = s.schedule()
                    ms = (time.perf_counter() - t0) * 1e3
                    loaded = sum(x.num_computed_tokens for x in out.scheduled_new_reqs)
                    if len(out.scheduled_new_reqs) != args.requests or loaded != args.requests * SHARED:
                        raise RuntimeError(f"{name}: {len(out.scheduled_new_reqs)} requests, {loaded} tokens hit")
                    if r:
                        rows[name].append(ms)
                        if s is pooled:
                            for c in CALLS:
                                calls[c].append(spent.get(c, 0.0))
                    s.finish_requests([f"b{r}-{i}" for i in range(args.requests)], RequestStatus.FINISHED_ABORTED)
        pooled.connector.shutdown()
    finally:
        pool.stop()
    out_json: dict[str, Any] = {"requests": args.requests, "rounds": args.rounds - 1, "schedule_ms_p50": {},
                                "connector_calls_ms_p50": {}}  # fmt: skip
    print(f"vLLM schedule() taking in a burst of {args.requests} x {PROMPT}-token prompts, {SHARED} tokens of each "
          f"held (p50 of {args.rounds - 1} rounds):")  # fmt: skip
    for name, v in rows.items():
        out_json["schedule_ms_p50"][name] = round(statistics.median(v), 3)
        print(f"  {name:18s} {statistics.median(v):7.2f} ms  {[round(x, 2) for x in v]}")
    for c, v in calls.items():
        out_json["connector_calls_ms_p50"][c] = round(statistics.median(v), 3)
        print(f"    connector {c:28s} {statistics.median(v):6.2f} ms in all")
    if args.json is not None:
        args.json.write_text(json.dumps(out_json, indent=1))


if __name__ == "__main__":
    main()
