"""Blocks copied between two CUDA arenas as one ``cuMemcpyBatchAsync`` call, byte for byte: between the arenas of
two GPUs and between two arenas of one GPU, through a worker's :func:`copy_blocks` (a client mapping each arena)
and the pool's :class:`ArenaCopier` (the pool's own mappings), VMM and legacy handles alike.

Each copy is checked against the source's bytes, and each test checks that the batch path ran (one driver call a
copy) wherever this driver has it; with a driver older than CUDA 12.8 the same copies go by gather and scatter."""

from __future__ import annotations

import ctypes
import random
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvpool import batchcopy
from kvpool.client import PoolClient
from kvpool.layout import KVLayout
from kvpool.transfer import copy_blocks
from tests.conftest import start_pool

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")

#: the arena of `kvpool bench vllm`'s resident engines, small: 16 layers, 8 KV heads, head dim 64, bf16
LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype="bfloat16", order="kv_packed")
ORDERS = ["kv_packed", "layer_major", "block_major"]
NUM_BLOCKS = 96


def flags(order: str, handle: str = "auto") -> list[str]:
    lay = LAYOUT.model_copy(update={"order": order})
    return ["--backend", "cuda", "--num-blocks", str(NUM_BLOCKS), "--num-layers", str(lay.num_layers),
            "--num-kv-heads", str(lay.num_kv_heads), "--head-dim", str(lay.head_dim), "--block-size",
            str(lay.block_size), "--dtype", lay.dtype, "--order", order, "--arena-handle", handle]  # fmt: skip


def driver_version() -> int:
    from kvpool import vmm

    version = ctypes.c_int()
    vmm.driver().cuDriverGetVersion(ctypes.byref(version))
    return version.value


@pytest.fixture
def issued(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The range count of every batch issued while the test runs."""
    calls: list[int] = []
    real = batchcopy.issue

    def spy(p: batchcopy.Plan, stream: int) -> None:
        calls.append(p.count)
        real(p, stream)

    monkeypatch.setattr(batchcopy, "issue", spy)
    return calls


def batches_expected() -> int:
    """1 where this driver has batch copies (one call a copy), else 0."""
    return 1 if batchcopy.available() else 0


def test_a_driver_of_cuda_12_8_or_later_has_batch_copies() -> None:
    version = driver_version()
    if version < 12080:
        pytest.skip(f"driver of CUDA {version}: batch copies need 12.8")
    assert batchcopy.available(), batchcopy.why_not()


def scattered(client: PoolClient, n: int, device: int, rng: random.Random) -> list[int]:
    """``n`` blocks of ``device``'s arena picked at random out of more, mostly not consecutive."""
    ids = client.alloc(2 * n, device=device)
    keep = rng.sample(ids, n)
    client.free([b for b in ids if b not in keep])
    return keep


def write_payload(arena, ids: list[int]) -> torch.Tensor:
    view, dim = arena.blocks_view()
    idx = torch.tensor(arena.local_ids(ids), device=arena.device)
    payload = torch.randn(view.index_select(dim, idx).shape, device=arena.device).to(view.dtype)
    view.index_copy_(dim, idx, payload)
    torch.cuda.synchronize(arena.device)
    return payload.cpu()


def read_back(arena, ids: list[int]) -> torch.Tensor:
    view, dim = arena.blocks_view()
    return view.index_select(dim, torch.tensor(arena.local_ids(ids), device=arena.device)).cpu()


def check_copy(src_client, src_dev, dst_client, dst_dev, issued: list[int], stream: bool) -> None:
    """Scattered blocks and a run of new ones copied over: the target blocks hold the source's bytes, and every other
    byte of the destination arena is as it was."""
    rng = random.Random(7)
    a, b = src_client.arena(device=src_dev), dst_client.arena(device=dst_dev)
    src, dst = scattered(src_client, 24, src_dev, rng), scattered(dst_client, 24, dst_dev, rng)
    src += src_client.alloc(8, device=src_dev)
    dst += dst_client.alloc(8, device=dst_dev)
    payload = write_payload(a, src)
    view, dim = b.blocks_view()
    want = view.cpu().index_copy_(dim, torch.tensor(b.local_ids(dst)), payload)
    expect = batches_expected()
    if stream:  # the caller's own stream on the destination: the copy is issued on it
        side = torch.cuda.Stream(device=b.device)
        with torch.cuda.stream(side):
            done = copy_blocks(a, src, b, dst)
    else:  # torch's default stream, which the driver refuses for batches: the copy runs beside it
        done = copy_blocks(a, src, b, dst)
    assert done is not None
    done.synchronize()
    assert torch.equal(view.cpu(), want)
    assert len(issued) == expect and batchcopy.available() == bool(expect), batchcopy.why_not()
    src_client.free(src)
    dst_client.free(dst)


@two_gpus
@pytest.mark.parametrize("handle", ["vmm", "legacy"])
@pytest.mark.parametrize("order", ORDERS)
def test_copy_blocks_between_two_gpus_arenas_moves_every_byte(order: str, handle: str, issued: list[int]) -> None:
    pool = start_pool(*flags(order, handle), "--devices", "0,1")
    try:
        with PoolClient(pool.url, name="copy") as client:
            for stream in (False, True):
                issued.clear()
                check_copy(client, 0, client, 1, issued, stream)
            issued.clear()
            src = client.alloc(16, device=0)
            payload = write_payload(client.arena(device=0), src)
            moved = client.move(src, device=1)
            torch.cuda.synchronize(1)
            assert torch.equal(read_back(client.arena(device=1), moved), payload)
            assert len(issued) == batches_expected()
            client.free(moved)
    finally:
        pool.stop()


@pytest.fixture
def two_pools_on_gpu0() -> Iterator[tuple[object, object]]:
    first = start_pool(*flags("kv_packed"), "--device", "0")
    try:
        second = start_pool(*flags("kv_packed"), "--device", "0")
    except BaseException:
        first.stop()
        raise
    yield first, second
    second.stop()
    first.stop()


def test_copy_blocks_between_two_arenas_of_one_gpu_moves_every_byte(two_pools_on_gpu0, issued: list[int]) -> None:
    """``--devices 0,0`` is refused, so two pools on one GPU: two arenas, both mapped here."""
    first, second = two_pools_on_gpu0
    with PoolClient(first.url, name="one") as c1, PoolClient(second.url, name="two") as c2:
        for stream in (False, True):
            issued.clear()
            check_copy(c1, 0, c2, 0, issued, stream)


def test_blocks_both_read_and_written_in_one_arena_copy_as_a_gather_would(issued: list[int]) -> None:
    """Within one arena, a copy onto blocks it also reads reads them all first (the gather path), and one onto other
    blocks is one batch."""
    pool = start_pool(*flags("kv_packed"), "--device", "0")
    try:
        _within_one_arena(pool, issued)
    finally:
        pool.stop()


def _within_one_arena(pool, issued: list[int]) -> None:
    with PoolClient(pool.url, name="one") as client:
        a = client.arena()
        ids = client.alloc(6)
        payload = write_payload(a, ids)
        copy_blocks(a, ids[:5], a, ids[1:]).synchronize()
        assert torch.equal(read_back(a, ids[1:]), payload[:, :5] if a.blocks_view()[1] == 1 else payload[:5])
        assert not issued
        others = client.alloc(5)
        copy_blocks(a, ids[1:], a, others).synchronize()
        assert torch.equal(read_back(a, others), read_back(a, ids[1:]))
        assert len(issued) == batches_expected()


# -- the pool's own copies ----------------------------------------------------------------------------------------


def owned_views(devices: list[int], handle: str, order: str, shm_dir: Path) -> tuple[list, list]:
    """Arenas as the pool creates them, and its own views of them (its mappings: a VMM one grants every peer)."""
    from kvpool import vmm
    from kvpool.server.arenas import create_owned_arena, describe
    from kvpool.server.tiermemory import blocks_view_of

    if handle == "vmm" and any(vmm.supported(d) for d in devices):
        pytest.skip("this GPU exports no VMM fds")
    layout = LAYOUT.model_copy(update={"order": order})
    arenas, views = [], []
    for d in devices:
        epoch = secrets.token_hex(8)
        arena = create_owned_arena("cuda", NUM_BLOCKS * layout.block_nbytes, device=d, shm_dir=shm_dir, epoch=epoch,
                                   arena_handle=handle, fd_passing=True)  # fmt: skip
        arenas.append(arena)
        views.append(blocks_view_of(describe(epoch, [d], [arena], [NUM_BLOCKS], layout, "", None).part(d), arena))
    return arenas, views


@pytest.mark.parametrize("handle", ["vmm", "legacy"])
@pytest.mark.parametrize(
    "devices", [pytest.param([0, 1], marks=two_gpus, id="two-gpus"), pytest.param([0, 0], id="one-gpu")]
)
def test_the_pools_arena_copier_moves_every_byte(devices, handle: str, issued: list[int], tmp_path: Path) -> None:
    from kvpool.server.tiercopy import ArenaCopier

    arenas, views = owned_views(devices, handle, "kv_packed", tmp_path)
    try:
        (src, dim), (dst, _) = views
        rng = random.Random(3)
        src_ids = rng.sample(range(1, NUM_BLOCKS), 40) + list(range(50, 58))
        dst_ids = rng.sample([b for b in range(1, NUM_BLOCKS) if b not in range(60, 68)], 40) + list(range(60, 68))
        idx = torch.tensor(src_ids, device=src.device)
        payload = torch.randn(src.index_select(dim, idx).shape, device=src.device).to(src.dtype)
        src.index_copy_(dim, idx, payload)
        dst.zero_()
        torch.cuda.synchronize(src.device)
        torch.cuda.synchronize(dst.device)
        ArenaCopier(views).copy(0, src_ids, 1, dst_ids)  # returns once the copy is done
        got = dst.index_select(dim, torch.tensor(dst_ids, device=dst.device))
        assert torch.equal(got.cpu(), payload.cpu())
        rest = [b for b in range(NUM_BLOCKS) if b not in dst_ids]
        assert not dst.index_select(dim, torch.tensor(rest, device=dst.device)).any()
        assert len(issued) == batches_expected()
    finally:
        for arena in arenas:
            arena.close()
