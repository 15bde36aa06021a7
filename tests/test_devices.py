"""One device's view of a pool of several arenas (CPU arenas here): plain arena indices in, fenced pool ids out, and
a claim of blocks parked on another device moved into this one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvpool.client import PoolClient
from kvpool.devices import DeviceSession
from kvpool.errors import StaleBlock
from kvpool.ids import block_of, generation_of
from kvpool.layout import KVLayout
from tests.conftest import LocalPool, local_pool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
N = 16  # blocks per arena: device 0's ids are 0..15, device 1's 16..31


@pytest.fixture(scope="module")
def two_arenas() -> Iterator[LocalPool]:
    pool = local_pool("--devices", "0,1", "--num-blocks", str(N), "--num-layers", "2", "--num-kv-heads", "2",
                      "--head-dim", "8", "--block-size", "4", "--dtype", "float32")  # fmt: skip
    yield pool
    pool.stop()


def test_indices_in_are_fenced_pool_ids_out_and_back(two_arenas: LocalPool) -> None:
    with PoolClient(two_arenas.url, name="dev-ids", layout=LAYOUT) as pool:
        dev = DeviceSession(pool, device=1)
        assert dev.first == N and dev.arena is pool.arena(device=1)
        local = dev.alloc(3)
        assert local == [0, 1, 2]  # indices into device 1's views, not the pool's 16, 17, 18
        assert dev.pool_ids(local) == [N, N + 1, N + 2]
        tokens = list(range(12))
        dev.commit(local, tokens)
        assert dev.free(local) == 3
        hit = dev.lookup(tokens)
        assert hit.block_ids == local and hit.num_tokens == 12
        copied = pool.lookup(tokens)  # device 0 held no such prefix: it gets a copy of device 1's
        assert copied.num_tokens == 12 and all(b < N for b in copied.block_ids)
        pool.free(copied.block_ids)
        dev.free(hit.block_ids)


def test_an_index_let_go_is_stale_when_its_block_is_someone_else_s(two_arenas: LocalPool) -> None:
    with PoolClient(two_arenas.url, name="dev-a") as a, PoolClient(two_arenas.url, name="dev-b") as b:
        dev = DeviceSession(a, device=0)
        local = dev.alloc(1)
        dev.free(local)
        theirs = b.alloc(1, device=0)
        assert block_of(theirs[0]) == local[0] and generation_of(theirs[0]) == generation_of(dev.pool_ids(local)[0]) + 1
        with pytest.raises(StaleBlock):  # the index names the grant dev gave up, whose generation has moved on since
            dev.free(local)
        b.free(theirs)


def test_a_claim_of_blocks_on_another_device_moves_them_here(two_arenas: LocalPool) -> None:
    with (
        PoolClient(two_arenas.url, name="dev-prefill", layout=LAYOUT) as p,
        PoolClient(two_arenas.url, name="dev-decode", layout=LAYOUT) as d,
    ):
        prefill, decode = DeviceSession(p, device=0), DeviceSession(d, device=1)
        local = prefill.alloc(2)
        torch.manual_seed(0)
        for layer in range(LAYOUT.num_layers):
            prefill.arena.k(layer)[local].copy_(torch.randn_like(prefill.arena.k(layer)[local]))
            prefill.arena.v(layer)[local].copy_(torch.randn_like(prefill.arena.v(layer)[local]))
        prefill.handoff("req-across", local, 8, meta={"first_token": 3})
        got = decode.claim("req-across", timeout_s=10)
        assert (got.request_id, got.num_tokens, got.meta) == ("req-across", 8, {"first_token": 3})
        assert all(0 <= i < N for i in got.block_ids) and list(got.ids) == got.block_ids
        for layer in range(LAYOUT.num_layers):
            assert torch.equal(decode.arena.k(layer)[got.block_ids], prefill.arena.k(layer)[local])
            assert torch.equal(decode.arena.v(layer)[got.block_ids], prefill.arena.v(layer)[local])
        s = two_arenas.stats()
        assert (s["arenas"][0]["in_use"], s["arenas"][1]["in_use"]) == (0, 2)  # the originals went back
        decode.free(got.block_ids)
