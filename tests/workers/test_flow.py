"""The workers as real processes around a real pool: disaggregated == monolithic (== transformers), prefix reuse.

Each test starts ``kvpool serve`` and the two workers with ``python -m``, as an operator would. The arena is on
the GPU when there is one (CUDA IPC between the processes), else in shared memory.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.client import PoolClient, http_client
from kvpool.workers import demo
from kvpool.workers.cli import TINY
from kvpool.workers.kvcache import layout_for
from kvpool.workers.model import LlamaModel
from kvpool.workers.monolithic import greedy_generate
from kvpool.workers.prefill import wait_for_session
from kvpool.workers.request import GenerationRequest
from tests.workers.helpers import hf_greedy, tiny_hf_checkpoint

pytestmark = pytest.mark.slow  # deselect with -m 'not slow'

BACKEND = "cuda" if torch.cuda.is_available() else "cpu"
DEVICE = torch.device(BACKEND)


@pytest.fixture
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvp-workers-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_disaggregated_equals_monolithic_and_transformers(workdir: Path) -> None:
    """One flow checks it all: token equality three ways, computed-token counts, and that no block leaks."""
    pytest.importorskip("transformers")
    ckpt = tiny_hf_checkpoint(workdir / "model")
    model = LlamaModel.from_pretrained(ckpt, DEVICE)
    bs = 8
    layout = layout_for(model.config, bs, "float32", "block_major")
    shared = list(range(30, 30 + 3 * bs))  # three full blocks
    prompts = [
        [*shared, 7, 8, 9, 10, 11],      # computes everything, commits 3 blocks
        [*shared, 100, 101],             # shares the 3 blocks: computes 2 tokens
        [4, 5, 6],                       # less than a block: nothing to hit
        [*shared, 7, 8, 9, 10, 11],      # a repeat: hits 3 blocks (the 4th is partial), computes 5
        [*shared[:bs], *[1] * (bs + 1)], # shares only the first block
    ]  # fmt: skip
    max_new = 12  # crosses block boundaries during decode
    requests = [GenerationRequest(f"r{i}", p, max_new) for i, p in enumerate(prompts)]

    pool = demo.start_pool(layout, 64, workdir, BACKEND, "tiny-hf")
    try:
        flow = demo.run_workers(pool.url, ["--model", str(ckpt)], requests, workdir, decode_args=["--max-batch", "3"])
        with http_client(pool.url, None, 5.0) as http:
            stats = http.get("/stats").json()
    finally:
        pool.stop()

    prefill = {r["request_id"]: r for r in flow.prefill}
    assert [prefill[f"r{i}"]["computed_tokens"] for i in range(5)] == [29, 2, 3, 5, 9]
    assert [prefill[f"r{i}"]["hit_tokens"] for i in range(5)] == [0, 24, 0, 24, 8]
    got = flow.tokens()
    disaggregated = [got[r.request_id] for r in requests]
    assert disaggregated == greedy_generate(model, prompts, max_new, layout)
    assert disaggregated == hf_greedy(ckpt, prompts, max_new, device=BACKEND)
    assert stats["in_use"] == 0 and stats["handoffs"] == 0, "a worker kept blocks"
    assert stats["cached"] >= 4


def test_a_salt_shares_a_prefix_only_with_requests_of_the_same_salt(workdir: Path) -> None:
    """Real workers: the same prompt under two tenants' salts and none is computed once per salt, and hits only
    its own salt's blocks; the tokens are the same whichever blocks were used."""
    pytest.importorskip("transformers")
    ckpt = tiny_hf_checkpoint(workdir / "model")
    model = LlamaModel.from_pretrained(ckpt, DEVICE)
    bs = 8
    layout = layout_for(model.config, bs, "float32", "block_major")
    prompt = [*range(40, 40 + 3 * bs), 5, 6, 7]  # three full blocks and a partial one
    salts = ["tenant-a", "tenant-b", "tenant-a", None, "tenant-b"]
    requests = [GenerationRequest(f"r{i}", prompt, 4, salt) for i, salt in enumerate(salts)]

    pool = demo.start_pool(layout, 64, workdir, BACKEND, "tiny-hf")
    try:
        flow = demo.run_workers(pool.url, ["--model", str(ckpt)], requests, workdir)
    finally:
        pool.stop()

    prefill = {r["request_id"]: r for r in flow.prefill}
    assert [prefill[f"r{i}"]["hit_tokens"] for i in range(5)] == [0, 0, 3 * bs, 0, 3 * bs]
    tokens = flow.tokens()
    assert all(tokens[f"r{i}"] == tokens["r0"] for i in range(5)) and len(tokens["r0"]) == 4


def test_demo_runs_and_agrees() -> None:
    out = _run_demo(["--json", "--max-new-tokens", "6", "--block-size", "8", "--order", "block_major"])
    assert out["all_match"] and out["backend"] == BACKEND
    assert out["hit_tokens"] > 0 and out["computed_tokens"] + out["hit_tokens"] == out["prompt_tokens"]
    assert out["blocks_in_use_after"] == 0


def _run_demo(argv: list[str]) -> dict[str, object]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = demo.main(argv)
    assert code == 0, buf.getvalue()
    return json.loads(buf.getvalue())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_demo_in_half_precision_matches_to_the_bit(dtype: str) -> None:
    """The prefix-hit requests are where packing differs most from the reference: batch invariance makes them equal."""
    out = _run_demo(["--json", "--dtype", dtype, "--max-new-tokens", "12"])
    assert out["all_match"] and out["batch_invariant"] and out["hit_tokens"] > 0


def test_a_bad_request_is_refused_to_its_sender_and_the_workers_serve_on(workdir: Path) -> None:
    """Token ids the model cannot embed: the prefill answers that request with an error line and serves the rest;
    a handoff whose meta names such a token is refused by the decode worker, its blocks freed, and it decodes on."""
    bs = 8
    pool = demo.start_pool(layout_for(TINY, bs, "float32", "block_major"), 64, workdir, BACKEND, "random-tiny-seed0")
    good = [GenerationRequest("a", [1, 2, 3], 3), GenerationRequest("b", [4, 5, 6, 7], 3)]
    lines = [
        good[0].to_json(),
        json.dumps({"request_id": "big", "prompt": [1, TINY.vocab_size], "max_new_tokens": 3}),
        json.dumps({"request_id": "neg", "prompt": [1, -5], "max_new_tokens": 3}),
        good[1].to_json(),
    ]
    (workdir / "requests.jsonl").write_text("\n".join(lines) + "\n")
    base = ["--pool", pool.url, "--random-model", "--threads", "1"]
    decoding = subprocess.Popen(
        [sys.executable, "-m", "kvpool.workers.decode", *base, "--name", "decode-0", "--num-requests", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with PoolClient(url=pool.url, name="bad-producer", role="prefill") as producer:
            wait_for_session(producer, "decode-0", 120)
            meta = {"prompt_len": 3, "first_token": TINY.vocab_size + 7, "max_new_tokens": 3, "arrived_at": 0.0,
                    "handed_off_at": 0.0, "computed_tokens": 3, "hit_tokens": 0}  # fmt: skip
            producer.handoff("evil", producer.alloc(1), 3, meta=meta, to="decode-0")
            prefill = subprocess.run(
                [sys.executable, "-m", "kvpool.workers.prefill", *base, "--handoff-to", "decode-0",
                 "--requests", str(workdir / "requests.jsonl")],
                capture_output=True, text=True, timeout=300,
            )  # fmt: skip
        stdout, stderr = decoding.communicate(timeout=300)
        with http_client(pool.url, None, 5.0) as http:
            stats = http.get("/stats").json()
    finally:
        if decoding.poll() is None:
            decoding.kill()
        pool.stop()
    out = {r["request_id"]: r for r in map(json.loads, prefill.stdout.splitlines())}
    assert set(out) == {"a", "big", "neg", "b"}, prefill.stderr
    assert "token id 512 is not in the model's vocabulary (0 to 511)" in out["big"]["error"]
    assert "token id -5 is negative" in out["neg"]["error"]
    assert "error" not in out["a"] and "error" not in out["b"]
    assert prefill.returncode == 1 and "Traceback" not in prefill.stderr, "exits 1 once done: some requests failed"
    done = {r["request_id"]: r for r in map(json.loads, stdout.splitlines())}
    assert set(done) == {"evil", "a", "b"} and decoding.returncode == 0, stderr
    assert "token id 519 is not in the model's vocabulary" in done["evil"]["error"]
    assert [len(done[r.request_id]["tokens"]) for r in good] == [3, 3]
    assert stats["in_use"] == 0 and stats["handoffs"] == 0, "a refused request kept blocks"
