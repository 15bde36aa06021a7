"""Resident engines on two pools, one per GPU, as on two nodes (skipped without two GPUs, vLLM or NIXL): a prefill
engine on pool A (GPU 0) parks, the decode engine on pool B (GPU 1) claims through B, which reads the blocks from
A's arena with NIXL; the decode engine's greedy tokens are a plain vLLM engine's with its own prefix cache, and no
block is copied by the engines (the pools' NIXL read is the only move)."""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs", allow_module_level=True)

from kvpool.server.remote.nixlagent import load_nixl  # noqa: E402

try:
    load_nixl()
except Exception as exc:  # whatever keeps NIXL from loading is the reason to skip
    pytest.skip(f"NIXL is not installed here ({exc})", allow_module_level=True)

pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")

from kvpool.benchmarks.vllm import on_gpu  # noqa: E402
from kvpool.integrations.vllm.connector import counters  # noqa: E402
from kvpool.integrations.vllm.remote import PEER_KEY  # noqa: E402
from kvpool.server import launch  # noqa: E402
from tests.conftest import PoolProcess, free_port  # noqa: E402
from tests.gpu.test_vllm_resident import NUM_BLOCKS, build_model, engine, greedy  # noqa: E402

BS = 16


def pool_on(gpu: int, port: int, peer: int, token: str) -> PoolProcess:
    workdir = Path(tempfile.mkdtemp(prefix=f"kvp-gpu{gpu}-"))
    sock = workdir / "kvpool.sock"
    argv = ["kvpool", "serve", "--backend", "cuda", "--device", str(gpu), "--num-layers", "4", "--num-kv-heads", "8",
            "--head-dim", "64", "--block-size", str(BS), "--dtype", "bfloat16", "--order", "kv_packed",
            "--num-blocks", str(NUM_BLOCKS), "--slabs", "--slab-regions", "8", "--slab-max-blocks", str(NUM_BLOCKS),
            "--peers", f"http://127.0.0.1:{peer}", "--token", token, "--socket", str(sock), "--port", str(port),
            "--log-level", "warning"]  # fmt: skip
    return launch.spawn(argv, socket=sock, port=port, log=workdir / "pool.log", env=launch.child_env(),
                        timeout_s=300, workdir=workdir)  # fmt: skip


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, PoolProcess, PoolProcess, str]]:
    torch.cuda.init()
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(counters) sends a function
    token = secrets.token_hex(16)
    os.environ["KVPOOL_TOKEN"] = token  # the connectors' token
    model = tmp_path_factory.mktemp("model")
    build_model(model, torch.bfloat16)
    pa, pb = free_port(), free_port()
    a = pool_on(0, pa, pb, token)
    try:
        b = pool_on(1, pb, pa, token)
        try:
            yield model, a, b, token
        finally:
            b.stop()
    finally:
        a.stop()


def test_resident_engines_on_two_pools_give_the_plain_engine_s_tokens(two_gpus) -> None:
    model, a, b, token = two_gpus
    g = torch.Generator().manual_seed(3)
    handed = torch.randint(10, 30000, (4, 9 * BS + 7), generator=g).tolist()
    with on_gpu(0):
        plain = engine(model, None, BS)
    want = [o.outputs[0].token_ids for o in greedy(plain, handed)]
    plain.llm_engine.engine_core.shutdown()
    del plain

    with on_gpu(0):  # each engine on its pool's GPU, over the pool's Unix socket (the arena's fd comes over it)
        prefill = engine(model, a.url, BS)
    with on_gpu(1):
        decode = engine(model, b.url, BS)
    parked = greedy(prefill, handed, max_tokens=1, params=[{"do_remote_decode": True}] * len(handed))
    params = [{**o.kv_transfer_params, PEER_KEY: f"http://127.0.0.1:{a.port}"} for o in parked]
    got = greedy(decode, handed, params=params)
    assert [o.outputs[0].token_ids for o in got] == want
    (count,) = decode.collective_rpc(counters)
    assert count["installed_blocks"] >= 4 * 9 and count["copied_blocks"] == 0
    auth = {"authorization": f"Bearer {token}"}
    remote = httpx.get(f"http://127.0.0.1:{b.port}/stats", headers=auth).json()["remote"]
    assert (remote["reads"], remote["read_blocks"], remote["failed"]) == (4, 4 * 9, 0)
    print(f"4 handoffs read from GPU 0's pool into GPU 1's: {remote['read_bytes']} bytes in {remote['read_s']:.4f} s, "
          f"{remote['descriptors']} descriptors")  # fmt: skip
    for llm in (prefill, decode):
        llm.llm_engine.engine_core.shutdown()
    for pool in (a, b):
        s = httpx.get(f"http://127.0.0.1:{pool.port}/stats", headers=auth).json()
        assert s["free"] + s["in_use"] + s["cached"] == s["num_blocks"]
