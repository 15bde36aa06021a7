"""A block copy planned as byte ranges moves what a gather and a scatter move, every layer's K and V of each block
and nothing else, in one range per run of consecutive ids and layer; and the driver call gets the plan as the
CUDA 12.8 ABI takes it (checked against a stand-in for the driver; the GPU tests make real ones)."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import batchcopy, vmm
from kvpool.arena import Arena
from kvpool.batchcopy import Geometry, plan
from kvpool.cuda import CudaError
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor
from kvpool.transfer import copy_blocks


def numbered(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Every element a number of its own, so that a byte copied to a wrong place shows."""
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape).to(dtype)


def expected(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int], dim: int) -> torch.Tensor:
    out = dst.clone()
    ids = [torch.tensor(i, dtype=torch.long) for i in (src_ids, dst_ids)]
    out.index_copy_(dim, ids[1], src.index_select(dim, ids[0]))
    return out


def apply_on_host(p: batchcopy.Plan, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Carry out a plan with ``memmove`` between the two tensors' bytes, each range first checked to lie in them:
    a wrong plan fails here, not by writing over memory of no tensor."""
    s_lo, d_lo = src.data_ptr(), dst.data_ptr()
    s_hi, d_hi = s_lo + src.numel() * src.element_size(), d_lo + dst.numel() * dst.element_size()
    for s, d, n in zip(p.srcs, p.dsts, p.sizes, strict=True):
        assert s_lo <= s and s + n <= s_hi, f"source range {s - s_lo}+{n} outside the source's {s_hi - s_lo} bytes"
        assert d_lo <= d and d + n <= d_hi, f"target range {d - d_lo}+{n} outside the target's {d_hi - d_lo} bytes"
        ctypes.memmove(d, s, n)


def applied(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int], dim: int) -> int:
    p = plan(src_ids, dst_ids, Geometry.of_view(src, dim), Geometry.of_view(dst, dim), src.data_ptr(), dst.data_ptr())
    apply_on_host(p, src, dst)
    assert p.nbytes == len(src_ids) * src.select(dim, 0).numel() * src.element_size()
    return p.count


@st.composite
def copies(draw: st.DrawFn) -> tuple[int, tuple[int, ...], tuple[int, ...], list[int], list[int], torch.dtype]:
    dim = draw(st.sampled_from([0, 1]))
    n_src, n_dst = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    outer, inner = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    count = draw(st.integers(0, n_dst))
    dst_ids = draw(st.permutations(range(n_dst)))[:count]  # distinct: a block written twice has no one answer
    src_ids = draw(st.lists(st.integers(0, n_src - 1), min_size=count, max_size=count))
    if draw(st.booleans()) and count <= n_src:  # often a consecutive request, as the allocator hands them out
        start_s, start_d = draw(st.integers(0, n_src - count)), draw(st.integers(0, n_dst - count))
        src_ids, dst_ids = list(range(start_s, start_s + count)), list(range(start_d, start_d + count))
    shape = (lambda n: (n, outer, inner)) if dim == 0 else (lambda n: (outer, n, inner))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.uint8]))
    return dim, shape(n_src), shape(n_dst), src_ids, dst_ids, dtype


@settings(max_examples=200, deadline=None)
@given(copies())
def test_a_plan_moves_exactly_what_a_gather_and_a_scatter_move(case) -> None:
    dim, src_shape, dst_shape, src_ids, dst_ids, dtype = case
    src, dst = numbered(src_shape, dtype), -numbered(dst_shape, torch.float32).to(dtype)
    want = expected(src, src_ids, dst, dst_ids, dim)
    count = applied(src, src_ids, dst, dst_ids, dim)
    assert torch.equal(dst, want)
    outer = 1 if dim == 0 else src_shape[0]
    assert count == outer * len(batchcopy.runs(src_ids, dst_ids)) <= outer * len(src_ids)


@pytest.mark.parametrize("dim", [0, 1])
def test_a_consecutive_request_is_one_range_per_layer_whatever_order_its_ids_come_in(dim: int) -> None:
    shape = (40, 3, 5) if dim == 0 else (3, 40, 5)
    src, dst = numbered(shape, torch.float32), torch.zeros(shape)
    src_ids, dst_ids = list(range(7, 23)), list(range(20, 36))
    pairs = list(zip(src_ids, dst_ids, strict=True))
    random.Random(0).shuffle(pairs)
    s, d = [p[0] for p in pairs], [p[1] for p in pairs]
    want = expected(src, s, dst, d, dim)
    assert applied(src, s, dst, d, dim) == (1 if dim == 0 else 3)
    assert torch.equal(dst, want)
    assert batchcopy.runs(s, d) == [(7, 20, 16)]


def test_runs_break_where_either_side_stops_stepping_by_one() -> None:
    assert batchcopy.runs([1, 2, 3, 7, 8], [10, 11, 5, 6, 7]) == [(1, 10, 2), (3, 5, 1), (7, 6, 2)]
    assert batchcopy.runs([4, 4], [1, 2]) == [(4, 1, 1), (4, 2, 1)]  # one source into two blocks: two ranges
    assert batchcopy.runs([], []) == []


def test_a_plan_that_would_touch_memory_of_no_block_is_refused() -> None:
    g = Geometry(outer=2, num_blocks=8, block_bytes=64)
    with pytest.raises(IndexError, match="source blocks outside"):
        plan([8], [0], g, g)
    with pytest.raises(IndexError, match="destination blocks outside"):
        plan([0], [-1], g, g)
    with pytest.raises(ValueError, match="different block geometries"):
        plan([0], [0], g, Geometry(outer=2, num_blocks=8, block_bytes=32))
    with pytest.raises(ValueError, match="2 source blocks against 1"):
        plan([0, 1], [0], g, g)
    assert plan([], [], g, g).count == 0


def test_ranges_follow_the_views_own_strides_when_the_arenas_differ_in_size() -> None:
    p = plan([3, 4], [0, 1], Geometry(2, 10, 100), Geometry(2, 5, 100), src_base=1000, dst_base=50_000)
    assert list(p.srcs) == [1000 + 300, 1000 + 1000 + 300]
    assert list(p.dsts) == [50_000, 50_000 + 500]
    assert list(p.sizes) == [200, 200]


LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=4, block_size=2, dtype="float16")


def arena(num_blocks: int, first_block: int, layout: KVLayout) -> Arena:
    raw = torch.zeros(num_blocks * layout.block_nbytes, dtype=torch.uint8)
    desc = ArenaDescriptor(epoch="t", backend="cpu", device=None, handle="", nbytes=raw.numel(), num_blocks=num_blocks,
                           block_nbytes=layout.block_nbytes, layout=layout, owner_pid=0,
                           first_block=first_block)  # fmt: skip
    return Arena(desc, raw)


@pytest.mark.parametrize("order", ["layer_major", "kv_packed", "block_major"])
def test_a_plan_between_two_arenas_does_what_copy_blocks_does(order: str) -> None:
    """Arenas of different sizes, ids of a pool with two arenas, each order's blocks view as it is cut."""
    layout = LAYOUT.model_copy(update={"order": order})
    a, b, c = arena(12, 0, layout), arena(9, 12, layout), arena(9, 12, layout)
    a.raw.view(torch.float16).copy_(numbered((a.raw.numel() // 2,), torch.float16))
    src_ids, dst_ids = [5, 6, 7, 0, 11], [12 + 2, 12 + 3, 12 + 4, 12 + 8, 12 + 0]
    copy_blocks(a, src_ids, b, dst_ids)  # the CPU path: gather and scatter
    (va, dim), (vc, _) = a.blocks_view(), c.blocks_view()
    geometry = Geometry.of_view(va, dim)
    assert geometry.outer * geometry.block_bytes == layout.block_nbytes
    assert geometry.outer == {"layer_major": 2 * layout.num_layers, "kv_packed": layout.num_layers}.get(order, 1)
    p = plan(a.local_ids(src_ids), c.local_ids(dst_ids), geometry, Geometry.of_view(vc, dim), va.data_ptr(),
             vc.data_ptr())  # fmt: skip
    apply_on_host(p, va, vc)
    assert p.count == geometry.outer * 3  # [5, 6, 7] -> [2, 3, 4] is one run
    assert torch.equal(c.raw, b.raw) and b.raw.any()


# -- the driver call, against a stand-in ------------------------------------------------------------------------


class FakeDriver:
    """``cuGetProcAddress_v2`` that hands out a C callback with ``cuMemcpyBatchAsync``'s 12.8 signature, which
    copies host memory as the copy engines would copy device memory, and records what it was given."""

    def __init__(self, code: int = 0, fail_at: int = 0, has_batch: bool = True) -> None:
        self.code, self.fail_at, self.has_batch = code, fail_at, has_batch
        self.calls: list[dict[str, object]] = []
        self.contexts: list[str] = []
        self.callback = batchcopy._BatchFn(self._batch)  # kept alive as long as the driver

    def _batch(self, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, stream) -> int:
        a = batchcopy.MemcpyAttributes.from_address(attrs)
        self.calls.append({
            "count": count, "num_attrs": num_attrs, "attrs_idx": ctypes.c_size_t.from_address(attrs_idxs).value,
            "order": a.srcAccessOrder, "flags": a.flags, "stream": stream,
        })  # fmt: skip
        if self.code:
            ctypes.c_size_t.from_address(fail_idx).value = self.fail_at
            return self.code
        d, s, n = ((ctypes.c_uint64 * count).from_address(x) for x in (dsts, srcs, sizes))
        for i in range(count):
            ctypes.memmove(d[i], s[i], n[i])
        return 0

    def cuGetProcAddress_v2(self, symbol, fn, version, flags, status) -> int:
        self.asked = (symbol, version, flags)
        if not self.has_batch:
            status._obj.value = 1  # CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
            return 500  # CUDA_ERROR_NOT_FOUND
        fn._obj.value = ctypes.cast(self.callback, ctypes.c_void_p).value
        status._obj.value = 0
        return 0

    def cuDriverGetVersion(self, version) -> int:
        version._obj.value = 12080 if self.has_batch else 12040
        return 0

    def cuStreamGetCtx(self, stream, ctx) -> int:
        ctx._obj.value = 0xC0
        return 0

    def cuCtxPushCurrent_v2(self, ctx) -> int:
        self.contexts.append(f"push {ctx.value:#x}")
        return 0

    def cuCtxPopCurrent_v2(self, ctx) -> int:
        self.contexts.append("pop")
        return 0

    def cuGetErrorString(self, code, text) -> int:
        text._obj.value = b"invalid argument"
        return 0


class Stream:
    cuda_stream = 0x5150


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """The module as a new process has it: nothing resolved, no failure seen."""
    for name, value in (("_resolved", False), ("_fn", None), ("_why_not", None)):
        monkeypatch.setattr(batchcopy, name, value)

    def install(fake: FakeDriver) -> FakeDriver:
        monkeypatch.setattr(vmm, "driver", lambda: fake)
        return fake

    return install


def test_the_driver_gets_destinations_sources_sizes_and_one_stream_ordered_attribute(fresh) -> None:
    fake = fresh(FakeDriver())
    assert batchcopy.available() and batchcopy.why_not() is None
    assert fake.asked == (b"cuMemcpyBatchAsync", 12080, 0)
    src, dst = numbered((4, 10, 6), torch.float32), torch.zeros(4, 7, 6)
    s, d = [9, 0, 1, 4], [6, 2, 3, 0]
    want = expected(src, s, dst, d, 1)
    assert batchcopy.copy(src, s, dst, d, 1, Stream())
    assert torch.equal(dst, want)
    (call,) = fake.calls
    assert call == {"count": 4 * 3, "num_attrs": 1, "attrs_idx": 0, "order": 1, "flags": 0, "stream": 0x5150}
    assert fake.contexts == ["push 0xc0", "pop"]  # issued in the stream's context, the thread's left as it was


def test_a_large_copy_goes_in_calls_of_whole_layers_that_together_move_it_all(fresh, monkeypatch) -> None:
    fake = fresh(FakeDriver())
    monkeypatch.setattr(batchcopy, "MAX_RANGES", 5)  # 2 runs a layer: 2 layers a call
    src, dst = numbered((5, 10, 6), torch.float32), torch.zeros(5, 9, 6)
    s, d = [1, 2, 7], [4, 5, 0]
    want = expected(src, s, dst, d, 1)
    assert batchcopy.copy(src, s, dst, d, 1, Stream())
    assert torch.equal(dst, want)
    assert [c["count"] for c in fake.calls] == [4, 4, 2]
    planner = batchcopy.Planner(s, d, Geometry.of_view(src, 1), Geometry.of_view(dst, 1), 7, 9)
    whole, parts = planner.plan(), [planner.plan(0, 2), planner.plan(2, 5)]
    for field in ("srcs", "dsts", "sizes"):
        assert getattr(whole, field) == getattr(parts[0], field) + getattr(parts[1], field)


def test_the_legacy_default_stream_is_refused_before_the_driver_sees_it(fresh) -> None:
    fake = fresh(FakeDriver())
    g = Geometry(1, 4, 8)
    with pytest.raises(ValueError, match="legacy default stream"):
        batchcopy.issue(plan([0], [1], g, g), 0)
    assert not fake.calls


def test_a_failed_batch_says_where_and_turns_batches_off_so_callers_copy_another_way(fresh, caplog) -> None:
    fake = fresh(FakeDriver(code=1, fail_at=2))
    g = Geometry(2, 8, 16)
    with pytest.raises(CudaError, match=r"cuMemcpyBatchAsync \(at range 2 of 4\) failed: invalid argument"):
        batchcopy.issue(plan([0, 5], [1, 3], g, g), Stream.cuda_stream)
    assert fake.contexts == ["push 0xc0", "pop"]
    src, dst = torch.ones(2, 8, 4), torch.zeros(2, 8, 4)
    assert not batchcopy.copy(src, [0], dst, [1], 1, Stream())
    assert not batchcopy.available() and "invalid argument" in (batchcopy.why_not() or "")
    assert "batch copies turned off" in caplog.text
    assert not batchcopy.copy(src, [0], dst, [1], 1, Stream()) and len(fake.calls) == 2  # not tried again


def test_a_driver_without_batch_copies_is_no_error_only_no_batch(fresh, caplog) -> None:
    fresh(FakeDriver(has_batch=False))
    caplog.set_level("DEBUG", logger="kvpool.batchcopy")
    assert not batchcopy.available()
    assert "not found in this driver (CUDA 12.4" in (batchcopy.why_not() or "")
    assert not batchcopy.copy(torch.ones(1, 2, 2), [0], torch.zeros(1, 2, 2), [1], 1, Stream())
    assert sum("no batch copies" in r.message for r in caplog.records) == 1  # said once


def test_blocks_both_read_and_written_in_one_arena_are_left_to_a_gather(fresh) -> None:
    fake = fresh(FakeDriver())
    view = numbered((2, 8, 4), torch.float32)
    assert not batchcopy.copy(view, [1, 2], view, [2, 3], 1, Stream()) and not fake.calls
    assert batchcopy.copy(view, [1, 2], view, [5, 6], 1, Stream()) and len(fake.calls) == 1


def test_no_driver_at_all_is_no_batch(fresh, monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise CudaError("the CUDA driver (libcuda.so.1) cannot be loaded")

    monkeypatch.setattr(vmm, "driver", missing)
    assert not batchcopy.available() and "cannot be loaded" in (batchcopy.why_not() or "")
