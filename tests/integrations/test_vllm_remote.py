"""Engines on two pools, two nodes' as far as one machine shows: a prefill parked on pool A is claimed by a decode
engine on pool B through B (``/remote/claim``), read into B's arena over NIXL (UCX TCP, host arenas) and installed
as a local claim is; a peer killed before or during B's read leaves the decode engine computing the prompt, B's blocks
back. Needs NIXL; the tests inside vLLM's own scheduler need vLLM too (the CI's vLLM lane)."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from kvpool.client import PoolClient
from kvpool.integrations.vllm import remote
from kvpool.integrations.vllm.plan import prompt_digest
from kvpool.integrations.vllm.proxy import build_app
from kvpool.integrations.vllm.remote import PEER_KEY
from kvpool.integrations.vllm.scheduler import DIGEST_KEY, FROM_KEY, HANDOFF_KEY
from tests.conftest import PoolProcess, free_port
from tests.integrations.test_vllm_proxy import HANDOFF, Engines
from tests.integrations.test_vllm_residency import BS as RES_BS
from tests.integrations.test_vllm_residency import Engine, books, holds
from tests.server.procs import serve
from tests.server.remote.test_reads import ENV, TOKEN, KillMidRead, Proxy, url  # skips this module without NIXL

RESIDENCY_POOL = ("--num-blocks", "64", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
                  "--block-size", "4", "--dtype", "float32", "--order", "kv_packed", "--slabs",
                  "--slab-max-blocks", "64")  # fmt: skip


def vllm_layout(num_blocks: int, *more: str) -> tuple[str, ...]:
    """A pool of the tiny model's layout (tests/integrations/test_vllm_scheduler.py)."""
    return ("--num-blocks", str(num_blocks), "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16",
            "--block-size", "16", "--dtype", "float32", *more)  # fmt: skip


def start(port: int, peers: list[str], flags: tuple[str, ...]) -> PoolProcess:
    sock = Path(tempfile.mkdtemp(prefix="kvp-")) / "kvpool.sock"
    args = ["--port", str(port), "--socket", str(sock), "--lease-ttl-s", "3", "--peers", ",".join(peers), *flags]
    return serve(args, port=port, socket=sock, env=ENV)


@contextlib.contextmanager
def two_pools(
    flags: tuple[str, ...], kill_after_claim: bool = False, kill_mid_read: KillMidRead | None = None
) -> Iterator[tuple[PoolProcess, PoolProcess, str]]:
    """Pools A and B, each the other's peer; and A's URL as B knows it. With ``kill_after_claim``, B knows A
    through a proxy that kills A once A answered B's claim, before B reads; with ``kill_mid_read`` (its pid and
    B's port are filled in here), one that kills A while B's read is in flight."""
    a_port, b_port = free_port(), free_port()
    a = start(a_port, [url(b_port)], flags)
    proxy = None
    if kill_mid_read is not None:
        kill_mid_read.pid, kill_mid_read.b_port = a.proc.pid, b_port
        proxy = Proxy(url(a_port), "/claim", kill_mid_read)
        flags = (*flags, "--peer-timeout-s", "60")  # the peer's death, not the deadline, must end the read
    elif kill_after_claim:
        proxy = Proxy(url(a_port), "/claim", lambda: os.kill(a.proc.pid, signal.SIGKILL))
    peer = url(proxy.port) if proxy is not None else url(a_port)
    b = start(b_port, [peer], flags)
    try:
        yield a, b, peer
    finally:
        if proxy is not None:
            proxy.close()
        b.stop()
        a.stop()


def remote_stats(pool: PoolProcess) -> dict[str, Any]:
    s = httpx.get(url(pool.port) + "/stats", headers={"authorization": f"Bearer {TOKEN}"}).json()
    assert s["free"] + s["in_use"] + s["cached"] == s["num_blocks"], s
    return s


@pytest.fixture(autouse=True)
def token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_TOKEN", TOKEN)  # every client here, the connector's included


# -- the proxy -----------------------------------------------------------------------------------------------


def test_the_proxy_names_the_prefill_engine_s_pool_for_a_decode_engine_on_another() -> None:
    engines = Engines()
    app = build_app("http://prefill", "http://decode", httpx.MockTransport(engines), prefill_pool="http://a:8470")
    assert TestClient(app).post("/v1/completions", json={"prompt": [1], "max_tokens": 8}).status_code == 200
    assert engines.seen[1][1]["kv_transfer_params"] == {**HANDOFF, PEER_KEY: "http://a:8470"}


def test_a_peer_that_is_no_url_is_no_hit_and_asks_no_pool() -> None:
    class Unreachable:
        session_id = "s"
        transport = None  # any call would fail

    assert remote.claim(Unreachable(), "k", "http://" + "a" * 600, 1.0) is None


class Asks:
    """A client whose pool answers remote lookups from ``answers`` (an exception: it raises that) and records
    what was asked and freed."""

    session_id = "s"

    def __init__(self, *answers: Any) -> None:
        self.answers, self.asked, self.freed = list(answers), 0, []
        self.transport = self

    def request(self, method: str, path: str, req: Any, wait_s: float = 0.0) -> Any:
        assert (method, path) == ("POST", "/remote/lookup")
        self.asked += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def free(self, ids: list[int]) -> int:
        self.freed += ids
        return len(ids)


def test_a_prompt_missing_more_than_k_blocks_takes_the_longer_answer_and_gives_the_other_back() -> None:
    from kvpool.errors import PeerFailed
    from kvpool.protocol import LookupResponse

    bs, prompt = 4, list(range(17))  # four full blocks
    near = LookupResponse(block_ids=[1, 2, 3], num_tokens=12)  # misses one block: not asked with k=1
    short = LookupResponse(block_ids=[1], num_tokens=4)
    longer = {"block_ids": [1, 5, 6, 7], "num_tokens": 16, "read_blocks": 3}
    client = Asks(longer, {"block_ids": [1], "num_tokens": 4}, PeerFailed("the pool has no peers"))
    got = remote.lookup_many(client, [prompt, prompt], [near, short], [None, None], 1, bs)
    assert client.asked == 1 and got[0] is near and list(got[1].block_ids) == [1, 5, 6, 7]
    assert client.freed == [1], "the local hit's ref, now held twice, goes back once"
    kept = remote.lookup_many(client, [prompt], [short], [None], 1, bs)
    assert kept == [short] and client.freed == [1, 1], "a remote answer no longer than the local one goes back"
    assert remote.lookup_many(client, [prompt], [short], [None], 1, bs) == [short], "a pool that fails: local hit"
    assert client.freed == [1, 1] and client.answers == []


# -- residency alone (no vLLM) --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_handoff_parked_on_one_pool_is_claimed_through_another_into_its_arena() -> None:
    with two_pools(RESIDENCY_POOL) as (a, b, peer):
        p, d = Engine(a.url, "prefill"), Engine(b.url, "decode")
        try:
            prompt = list(range(3, 3 + 3 * RES_BS + 2))
            blocks = p.res.take(4)
            p.compute(blocks[:3], prompt)
            p.res.park("k1", blocks, prompt, {"digest": "x"})
            p.res.leave(blocks)
            p.res.drain()
            d.res.prefetch("r1", prompt, claim="k1", digest="x", parker=p.client.session.name, peer=peer)
            hit = d.res.answer("r1")
            assert hit is not None and hit.claimed and hit.num_tokens == 3 * RES_BS and len(hit.ids) == 3
            got, _ = d.res.install("r1", hit, 3)
            assert holds(d.arena, got, prompt), "B's blocks hold what A's engine computed"
            assert remote_stats(a)["handoffs"] == 0 and remote_stats(b)["remote"]["reads"] == 1
        finally:
            p.close()
            d.close()
        assert books(a.url)["in_use"] == 1 and books(b.url)["in_use"] == 1  # the null blocks alone


@pytest.mark.slow
def test_a_handoff_a_peer_cannot_give_is_no_hit_and_the_read_s_blocks_go_back() -> None:
    with two_pools(RESIDENCY_POOL, kill_after_claim=True) as (a, b, peer):
        p, d = Engine(a.url, "prefill"), Engine(b.url, "decode")
        try:
            prompt = list(range(5, 5 + 2 * RES_BS + 1))
            blocks = p.res.take(2)
            p.compute(blocks, prompt)
            p.res.park("k2", blocks, prompt, {})
            p.res.drain()
            p.client.close()  # the handoff outlives its engine's session; A dies at B's claim
            d.res.prefetch("r2", prompt, claim="k2", peer=peer)
            hit = d.res.answer("r2")
            assert hit is not None and not hit.ids, "nothing to install: the engine computes the prompt"
            s = remote_stats(b)
            assert s["remote"]["failed"] == 1 and s["in_use"] == len(d.res.held) + 1, "the read's blocks went back"
        finally:
            p.res.close()
            d.close()
        assert books(b.url)["in_use"] == 1


@pytest.mark.slow
def test_a_remote_claim_with_no_room_here_is_no_hit_and_the_local_claims_beside_it_still_load() -> None:
    with two_pools(RESIDENCY_POOL) as (a, b, peer):
        p, d, local = Engine(a.url, "prefill"), Engine(b.url, "decode"), Engine(b.url, "prefill-here")
        try:
            there, here = list(range(9, 9 + 2 * RES_BS + 1)), list(range(50, 50 + 2 * RES_BS + 1))
            for engine, key, prompt in ((p, "k4", there), (local, "k5", here)):
                blocks = engine.res.take(2)
                engine.compute(blocks, prompt)
                engine.res.park(key, blocks, prompt, {})
                engine.res.drain()
            with PoolClient(b.url, name="hog") as hog:
                hog.alloc(remote_stats(b)["free"])
                # a claim that waits out its timeout first: the two after it go to the pool in one batch
                d.res.prefetch("r0", here, claim="parked-nowhere")
                d.res.prefetch("r5", here, claim="k5")
                d.res.prefetch("r4", there, claim="k4", peer=peer)
                hit = d.res.answer("r5")
                assert hit is not None and len(hit.ids) == 2, "the local claim loads"
                got, _ = d.res.install("r5", hit, 2)
                assert holds(d.arena, got, here)
                missed = d.res.answer("r4")
                assert missed is not None and not missed.ids and d.res.gone is None, "no room: computed, not lost"
                assert remote_stats(b)["remote"]["reads"] == 0
        finally:
            for engine in (p, d, local):
                engine.close()
        assert books(b.url)["in_use"] == 1


# -- inside vLLM's own scheduler ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def safety() -> ModuleType:
    """The resident engine helpers (vLLM's own Scheduler, on the CPU): this test runs where vLLM is installed."""
    pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")
    from tests.integrations import test_vllm_resident_safety

    return test_vllm_resident_safety


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, safety: ModuleType) -> Path:
    return Path(safety.tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def run_prefill(safety: ModuleType, sched: Any, prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
    """A prefill for another engine, run to its end: its blocks, and the kv_transfer_params it answered with."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=1, ignore_eos=True, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
    sched.add_request(Request("p1", prompt, sp, None, block_hasher=get_request_block_hasher(safety.BS, safety.HASH)))
    deadline = time.monotonic() + 30
    blocks: list[int] = []
    while time.monotonic() < deadline:
        out = sched.schedule()
        for new in out.scheduled_new_reqs:
            blocks = list(new.block_ids[0])
        ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        result = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[7] for _ in ids])  # fmt: skip
        for outputs in sched.update_from_output(out, result).values():
            for o in outputs.outputs:
                if o.finished:
                    assert o.kv_transfer_params, "a prefill for another engine answers with its handoff"
                    return blocks, dict(o.kv_transfer_params)
        time.sleep(0.01)
    raise AssertionError("the prefill never finished")


def decode_request(safety: ModuleType, prompt: list[int], params: dict[str, Any]) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    sp = SamplingParams(max_tokens=4, ignore_eos=True, extra_args={"kv_transfer_params": params})
    return Request("d1", prompt, sp, None, block_hasher=get_request_block_hasher(safety.BS, safety.HASH))


def test_resident_engines_on_two_pools_hand_a_prefill_over_as_on_one(
    safety: ModuleType, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bs = safety.BS
    with two_pools(vllm_layout(safety.NUM_BLOCKS, "--order", "kv_packed", "--slabs", "--slab-max-blocks",
                               str(safety.NUM_BLOCKS))) as (a, b, peer):  # fmt: skip
        prompt = list(range(40, 40 + 3 * bs + 5))
        with (safety.running(model_dir, a.url, monkeypatch) as p,
              PoolClient(a.url, name="forward-a", layout=safety.PACKED) as at_a):  # fmt: skip
            blocks, params = run_prefill(safety, p, prompt)
            arena_a = at_a.arena()
            for i, block in enumerate(blocks[:3]):  # the forward's KV, standing in for the model's
                for t in arena_a.block(block):
                    t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + 1000 * (i + 1))
            want = [t.clone() for block in blocks[:3] for t in arena_a.block(block)]
            p.connector._resident_sched.residency.drain()  # type: ignore[union-attr]
            assert params[FROM_KEY] and params[HANDOFF_KEY]
            with (safety.running(model_dir, b.url, monkeypatch) as d,
                  PoolClient(b.url, name="forward-b", layout=safety.PACKED) as at_b):  # fmt: skip
                assert safety.first_hit(d, decode_request(safety, prompt, {**params, PEER_KEY: peer})) == 3 * bs
                [installed] = [r for r in d.requests.values() if r.request_id == "d1"]
                got = d.kv_cache_manager.get_block_ids("d1")[0][:3]
                arena_b = at_b.arena()
                assert all(torch.equal(x, t) for x, t in
                           zip(want, [t for block in got for t in arena_b.block(block)], strict=True))  # fmt: skip
                assert installed.num_computed_tokens >= 3 * bs
                s = remote_stats(b)["remote"]
                assert (s["reads"], s["read_blocks"], s["failed"]) == (1, 3, 0)
                assert s["claim_indexed"] == 3, "indexed on B too: A's index vouched for the blocks it handed over"
            assert remote_stats(a)["handoffs"] == 0
        assert remote_stats(a)["in_use"] == 1 and remote_stats(b)["in_use"] == 1


def test_a_resident_decode_engine_whose_peer_dies_mid_read_computes_the_prompt(
    safety: ModuleType, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bs = safety.BS
    flags = vllm_layout(safety.NUM_BLOCKS, "--order", "kv_packed", "--slabs", "--slab-max-blocks",
                        str(safety.NUM_BLOCKS))  # fmt: skip
    kill = KillMidRead(0, 0)
    with two_pools(flags, kill_mid_read=kill) as (a, b, peer):
        prompt = list(range(60, 60 + 2 * bs + 3))
        salt = safety.salt_of(model_dir, a.url)
        with PoolClient(a.url, name="prefill", layout=safety.PACKED) as prefill:
            ids = prefill.alloc(2)
            prefill.commit(ids, prompt[: 2 * bs], salt=salt)
            digest = prompt_digest(prompt, salt)
            prefill.handoff("k3", ids, num_tokens=2 * bs, meta={"digest": digest})
            params = {HANDOFF_KEY: "k3", DIGEST_KEY: digest, FROM_KEY: prefill.session.name, PEER_KEY: peer}
        with safety.running(model_dir, b.url, monkeypatch) as d:
            assert safety.first_hit(d, decode_request(safety, prompt, params)) == 0, "recomputed, no crash"
            assert kill.in_flight["reads_in_flight"] == 1 and kill.in_flight["reading_blocks"] == 2
            s = remote_stats(b)
            assert s["remote"]["failed"] == 1 and s["remote"]["stalled_blocks"] == 0
        assert remote_stats(b)["in_use"] == 1, "the read's blocks and the engine's went back"


def test_copy_mode_engines_on_two_pools_hand_a_prefill_over_as_on_one(safety: ModuleType, model_dir: Path) -> None:
    from tests.integrations import test_vllm_scheduler as copy

    bs = copy.BS
    with two_pools(vllm_layout(128)) as (a, b, peer):
        p, d = copy.Engine(copy.config(model_dir, a.url)), copy.Engine(copy.config(model_dir, b.url))
        try:
            prompt = copy.prompt_of(4, 2 * bs + 5)
            req = copy.request("p1", prompt, {"do_remote_decode": True})
            p.sched.add_request(req)
            blocks_p, _, _ = p.step()["p1"]
            _, params = p.sched.connector.request_finished(req, blocks_p)
            assert params is not None
            p.sched.connector._sched.drain()  # type: ignore[union-attr]
            d.sched.add_request(copy.request("d1", prompt, {**params, PEER_KEY: peer}))
            blocks_d, computed_d, scheduled_d = d.step()["d1"]
            assert (computed_d, scheduled_d) == (2 * bs, 5)
            for kp, kd in zip(p.kv(blocks_p, 2 * bs), d.kv(blocks_d, 2 * bs), strict=True):
                assert torch.equal(kp, kd)
            assert remote_stats(b)["remote"]["reads"] == 1
            assert remote_stats(b)["remote"]["claim_indexed"] == 2, "indexed on B: A's index vouched for them"
        finally:
            p.close()
            d.close()


# -- a prefix held by another node's pool ---------------------------------------------------------------------


def test_a_copy_mode_engine_hits_a_prefix_an_engine_on_another_pool_computed(
    safety: ModuleType, model_dir: Path
) -> None:
    from tests.integrations import test_vllm_scheduler as copy

    bs = copy.BS
    with two_pools(vllm_layout(128)) as (a, b, _):
        asks = copy.config(model_dir, b.url)
        asks.kv_transfer_config.kv_connector_extra_config["peer_prefix_blocks"] = 0
        keeps_out = copy.config(model_dir, b.url)
        keeps_out.kv_transfer_config.kv_connector_extra_config["save"] = False  # leaves B's index as it was
        p, plain, d = copy.Engine(copy.config(model_dir, a.url)), copy.Engine(keeps_out), copy.Engine(asks)
        try:
            shared = copy.prompt_of(1, 3 * bs)
            pa, pb = shared + copy.prompt_of(2, 20), shared + copy.prompt_of(3, 9)
            p.sched.add_request(copy.request("a1", pa))
            blocks_a, computed_a, _ = p.step()["a1"]
            assert computed_a == 0
            plain.sched.add_request(copy.request("c1", pb))
            assert plain.step()["c1"][1] == 0, "an engine that does not ask B's peers computes the prompt"
            d.sched.add_request(copy.request("b1", pb))
            blocks_b, computed_b, scheduled_b = d.step()["b1"]
            assert (computed_b, scheduled_b) == (len(shared), len(pb) - len(shared))
            for ka, kb in zip(p.kv(blocks_a, len(shared)), d.kv(blocks_b, len(shared)), strict=True):
                assert torch.equal(ka, kb)
            s = remote_stats(b)["remote"]
            assert (s["reads"], s["read_blocks"], s["chain_mismatch"]) == (1, 3, 0)
        finally:
            for engine in (p, plain, d):
                engine.close()
        assert remote_stats(b)["in_use"] == 0 and remote_stats(b)["cached"] >= 3, "indexed on B, held by nobody"


def test_a_resident_engine_hits_a_prefix_a_resident_engine_on_another_pool_computed(
    safety: ModuleType, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bs = safety.BS
    flags = vllm_layout(safety.NUM_BLOCKS, "--order", "kv_packed", "--slabs", "--slab-max-blocks",
                        str(safety.NUM_BLOCKS))  # fmt: skip
    with two_pools(flags) as (a, b, _):
        prompt = list(range(70, 70 + 3 * bs + 5))
        with (safety.running(model_dir, a.url, monkeypatch) as p,
              PoolClient(a.url, name="forward-a", layout=safety.PACKED) as at_a):  # fmt: skip
            assert safety.first_hit(p, safety.req("a1", prompt)) == 0
            arena_a = at_a.arena()
            for i, block in enumerate(p.kv_cache_manager.get_block_ids("a1")[0][:3]):  # the forward's KV
                for t in arena_a.block(block):
                    t.copy_(torch.arange(t.numel(), dtype=t.dtype).view(t.shape) + 1000 * (i + 1))
            want = [t.clone() for block in p.kv_cache_manager.get_block_ids("a1")[0][:3] for t in arena_a.block(block)]
            while p.requests:  # to its end: its full blocks are committed on A
                safety.step(p)
            p.connector._resident_sched.residency.drain()  # type: ignore[union-attr]
        with (safety.running(model_dir, b.url, monkeypatch) as plain,
              safety.running(model_dir, b.url, monkeypatch, peer_prefix_blocks=0) as d,
              PoolClient(b.url, name="forward-b", layout=safety.PACKED) as at_b):  # fmt: skip
            assert safety.first_hit(plain, safety.req("c1", prompt)) == 0, "an engine that does not ask computes it"
            assert safety.first_hit(d, safety.req("d1", prompt)) == 3 * bs
            arena_b = at_b.arena()
            got = [t for block in d.kv_cache_manager.get_block_ids("d1")[0][:3] for t in arena_b.block(block)]
            assert all(torch.equal(x, y) for x, y in zip(want, got, strict=True)), "B's blocks hold A's KV"
            s = remote_stats(b)["remote"]
            assert (s["reads"], s["read_blocks"], s["chain_mismatch"]) == (1, 3, 0)
        assert remote_stats(a)["in_use"] == 1 and remote_stats(b)["in_use"] == 1  # the null blocks alone
