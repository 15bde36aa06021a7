"""The workers as real processes around a real pool: disaggregated == monolithic (== transformers), prefix reuse.

Each test starts ``kvpool serve`` and the two workers with ``python -m``, as an operator would. The arena is on
the GPU when there is one (CUDA IPC between the processes), else in shared memory.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool.client import http_client
from kvpool.workers import demo
from kvpool.workers.kvcache import layout_for
from kvpool.workers.model import LlamaModel
from kvpool.workers.monolithic import greedy_generate
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
