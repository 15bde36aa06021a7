"""The worker memory side of resident mode on vLLM 0.29+ (kvpool/integrations/vllm/memory.py), on the CPU.

With a vLLM of 0.29 or later installed, vLLM's own planner and ``allocate_kv_cache`` build the views of one backing,
and every (layer, block, token, head) of K and V must be where kvpool's kv_packed layout puts it. The rest (which
request gets the arena, the zero fill, the refusals) needs no vLLM.
"""

from __future__ import annotations

import contextlib
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from kvpool.errors import LayoutMismatch
from kvpool.integrations.vllm import arenapool, memory
from kvpool.integrations.vllm.kvmemory import ArenaKV
from kvpool.layout import KVLayout

LAYERS, HEADS, HEAD_DIM, BLOCKS = 3, 2, 8, 6
MiB = 1 << 20


def layout(block_size: int = 16, dtype: str = "bfloat16") -> KVLayout:
    return KVLayout(
        num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, block_size=block_size, dtype=dtype, order="kv_packed"
    )


def arena(lay: KVLayout, spare: int = 0) -> ArenaKV:
    raw = torch.zeros(BLOCKS * lay.block_nbytes + spare, dtype=torch.int8)
    return ArenaKV(raw, lay, BLOCKS)


def layer_index(name: str) -> int:
    return int(re.findall(r"\d+", name)[0])


def tensor(lay: KVLayout, **change: Any) -> SimpleNamespace:
    page = lay.block_nbytes // lay.num_layers
    fields = dict(
        size=BLOCKS * lay.block_nbytes, layers=[f"model.layers.{i}.self_attn.attn" for i in range(lay.num_layers)],
        layer_stride=BLOCKS * page, block_stride=page, offset=0, host_resident=False,
    )  # fmt: skip
    return SimpleNamespace(**{**fields, **change})


def config(*tensors: SimpleNamespace, num_blocks: int = BLOCKS) -> SimpleNamespace:
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=list(tensors))


# --- the zero fill ----------------------------------------------------------------------------------------------


class Spy(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in (torch.zeros, torch.empty):
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_attaching_turns_only_the_kv_backing_s_zeros_into_empty() -> None:
    spy = Spy()
    with spy, memory.ZerosAsEmpty(4096) as mode:
        backing = torch.zeros(4096, dtype=torch.int8, device="cpu")
        other_size = torch.zeros(4095, dtype=torch.int8)
        other_dtype = torch.zeros(4096, dtype=torch.float16)
    assert spy.calls == ["empty", "zeros", "zeros"]
    assert mode.turned == 1
    assert backing.numel() == 4096 and backing.dtype == torch.int8
    assert not other_size.any() and not other_dtype.any()


# --- the context's books ------------------------------------------------------------------------------------------


class BooksOnly:
    """The pool without CUDA: the test plays torch's allocator by asking the handout itself."""

    def __init__(self, handout: arenapool.Handout) -> None:
        self.handout, self.error, self.pool = handout, None, None


@pytest.fixture
def no_cuda_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "ArenaPool", BooksOnly)
    monkeypatch.setattr(memory, "_device_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda pool, device=None: contextlib.nullcontext())


def test_the_context_refuses_at_exit_unless_the_arena_became_the_backing_and_starts_afresh_each_time(
    no_cuda_pool: None,
) -> None:
    kv = arena(layout())
    n = memory.kv_bytes(kv)
    ctx = memory.arena_context(kv, attaching=True)
    spy = Spy()
    with spy, ctx:
        assert ctx.pool is not None and ctx.pool.handout.take(arenapool.segment_bytes(n), 0) == kv.raw.data_ptr()
        torch.zeros(n, dtype=torch.int8)
    assert spy.calls == ["empty"]  # attaching: the backing's zeros became empty
    with ctx:  # vLLM enters it again (a second allocation): the arena is handed again, not "already taken"
        assert ctx.pool is not None and ctx.pool.handout.take(arenapool.segment_bytes(n), 0) == kv.raw.data_ptr()
    with pytest.raises(LayoutMismatch, match="did not fit the arena"), ctx:
        assert ctx.pool is not None and ctx.pool.handout.take(n + 4 * MiB, 0) is None  # not the arena's size
    with pytest.raises(ValueError, match="vLLM's own"), ctx:
        raise ValueError("vLLM's own error is not masked by the arena's")


# --- the plan ---------------------------------------------------------------------------------------------------


def test_the_default_plan_of_a_model_shaped_like_the_arena_passes() -> None:
    lay = layout()
    memory.check_plan(arena(lay), config(tensor(lay)), layer_index, "LBNHC")
    memory.check_plan(arena(lay), SimpleNamespace(**vars(config(tensor(lay))), kv_cache_layout="LBNHC"), layer_index)


def test_the_plan_s_own_layout_is_checked_and_an_unresolved_one_refused() -> None:
    lay = layout()
    with pytest.raises(LayoutMismatch, match="as LBHNC"):
        memory.check_plan(
            arena(lay), SimpleNamespace(**vars(config(tensor(lay))), kv_cache_layout="LBHNC"), layer_index
        )
    with pytest.raises(LayoutMismatch, match="unresolved"):
        memory.check_plan(arena(lay), config(tensor(lay)), layer_index)


@pytest.mark.parametrize(
    ("plan", "vllm_layout", "says"),
    [
        (lambda lay: config(tensor(lay)), "LBHNC", "VLLM_KV_CACHE_LAYOUT"),
        (lambda lay: config(tensor(lay)), "BLNHC", "VLLM_KV_CACHE_LAYOUT"),
        (lambda lay: config(tensor(lay), num_blocks=BLOCKS + 1), "LBNHC", f"--num-gpu-blocks-override {BLOCKS}"),
        (lambda lay: config(tensor(lay), tensor(lay)), "LBNHC", "copy mode"),
        (lambda lay: config(tensor(lay, host_resident=True)), "LBNHC", "copy mode"),
        (lambda lay: config(tensor(lay, offset=64)), "LBNHC", "--num-kv-heads"),
        (lambda lay: config(tensor(lay, block_stride=tensor(lay).block_stride + 64)), "LBNHC", "--head-dim"),
        (lambda lay: config(tensor(lay, layers=tensor(lay).layers[:2])), "LBNHC", "--num-layers"),
        (lambda lay: config(tensor(lay, layers=tensor(lay).layers[::-1])), "LBNHC", "order [2, 1, 0]"),
    ],
    ids=["hnd", "block-outer", "blocks", "two-placements", "host", "offset", "padded", "layers", "order"],
)
def test_a_plan_whose_views_are_not_the_arena_is_refused_naming_the_setting(
    plan: Any, vllm_layout: str, says: str
) -> None:
    lay = layout()
    with pytest.raises(LayoutMismatch, match=re.escape(says)):
        memory.check_plan(arena(lay), plan(lay), layer_index, vllm_layout)


# --- vLLM's own views over the arena ----------------------------------------------------------------------------


def vllm_plan(lay: KVLayout, vllm_layout: str = "LBNHC", num_blocks: int = BLOCKS) -> Any:
    """vLLM's own KV plan (its ``KVCacheConfig``) for a model shaped like ``lay``, from its own planner."""
    vllm = pytest.importorskip("vllm")
    if tuple(int(x) for x in vllm.__version__.split(".")[:2]) < (0, 29):
        pytest.skip("this vLLM allocates per layer (before 0.29): kvmemory.py's path")
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    try:
        from vllm.v1.core import kv_cache_planning as planning
    except ImportError:
        from vllm.v1.core import kv_cache_utils as planning  # 0.29-0.32

    physical = KVCacheLayout[vllm_layout]
    specs = {
        f"model.layers.{i}.self_attn.attn": FullAttentionSpec(
            block_size=lay.block_size, num_kv_heads=lay.num_kv_heads, head_size=lay.head_dim,
            dtype=getattr(torch, lay.dtype),
        )
        for i in range(lay.num_layers)
    }  # fmt: skip
    groups = planning.create_kv_cache_group_specs(specs, [list(specs)])
    cache = SimpleNamespace(
        num_gpu_blocks_override=num_blocks, prefix_cache_retention_interval=None,
        get_resolved_kv_cache_layout=lambda: physical,
    )  # fmt: skip
    vllm_config = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))
    return planning.get_kv_cache_config_from_groups(vllm_config, groups, 1 << 40)


def vllm_views(raw: torch.Tensor, lay: KVLayout, vllm_layout: str, kernel: int | None) -> tuple[Any, dict]:
    """vLLM's plan for a model shaped like ``lay`` and its own views of ``raw`` as the one backing (its
    ``allocate_kv_cache``, on the CPU, with ``torch.zeros`` of the backing handing ``raw`` back as the arena pool does
    on the GPU)."""
    plan = vllm_plan(lay, vllm_layout)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    class Backing(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func is torch.zeros and args == (plan.kv_cache_tensors[0].size,):
                return raw[: args[0]]
            return func(*args, **(kwargs or {}))

    with Backing():
        views = allocate_kv_cache(plan, torch.device("cpu"), KVCacheLayout[vllm_layout], [kernel] if kernel else None)
    return plan, views


COMBOS = [
    (16, "bfloat16", None),
    (16, "float16", None),
    (32, "bfloat16", None),
    (32, "float16", None),
    (32, "bfloat16", 16),
]


@pytest.mark.parametrize(
    ("block_size", "dtype", "kernel"), COMBOS, ids=["16-bf16", "16-fp16", "32-bf16", "32-fp16", "32-kernel16"]
)
def test_vllm_s_views_of_its_one_backing_are_the_arena_s_layer_regions(
    block_size: int, dtype: str, kernel: int | None
) -> None:
    lay = layout(block_size, dtype)
    kv = arena(lay, spare=4096)
    plan, views = vllm_views(kv.raw, lay, "LBNHC", kernel)
    memory.check_plan(kv, plan, layer_index, "LBNHC")
    memory.check_bound(kv, views, layer_index)

    # every element of K and V, written through kvpool's own views, is read back at the same place through vLLM's
    typed = kv.raw[: BLOCKS * lay.block_nbytes].view(getattr(torch, dtype))
    for layer in range(LAYERS):
        for half in (0, 1):
            offset, shape, strides = lay.view_geometry(BLOCKS, layer, half)
            ours = typed.as_strided(shape, strides, offset)  # [block, token, head, head_dim]
            n = ours.numel()
            ours.copy_((torch.arange(n) % 251 + 1000 * layer + 500 * half).reshape(shape).to(ours.dtype))
    for name, view in views.items():
        layer = layer_index(name)
        theirs = view.reshape(BLOCKS, -1, HEADS, block_size // (view.shape[0] // BLOCKS), 2 * HEAD_DIM)
        theirs = theirs.permute(0, 1, 3, 2, 4).reshape(
            BLOCKS, block_size, HEADS, 2 * HEAD_DIM
        )  # [block, token, head, K|V]
        for half in (0, 1):
            offset, shape, strides = lay.view_geometry(BLOCKS, layer, half)
            ours = typed.as_strided(shape, strides, offset)
            assert torch.equal(theirs[..., half * HEAD_DIM : (half + 1) * HEAD_DIM], ours)
        assert view.data_ptr() == kv.layer(layer).data_ptr()
    assert kv.raw[BLOCKS * lay.block_nbytes :].eq(0).all(), "vLLM's views reach past the arena's KV span"


def test_vllm_s_own_zeros_of_the_backing_is_what_attaching_turns_into_empty() -> None:
    lay = layout()
    kv = arena(lay)
    plan, _ = vllm_views(kv.raw, lay, "LBNHC", None)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spy = Spy()
    with spy, memory.ZerosAsEmpty(memory.kv_bytes(kv)) as mode:
        allocate_kv_cache(plan, torch.device("cpu"), KVCacheLayout.LBNHC, None)
    assert mode.turned == 1 and spy.calls == ["empty"]


@pytest.mark.parametrize("vllm_layout", ["LBHNC", "LHBNC", "BLNHC", "BLHNC", "BHLNC"])
def test_every_other_vllm_layout_is_refused_by_the_plan_and_by_the_bound_check(vllm_layout: str) -> None:
    lay = layout()
    kv = arena(lay)
    plan, views = vllm_views(kv.raw, lay, vllm_layout, None)
    with pytest.raises(LayoutMismatch, match="VLLM_KV_CACHE_LAYOUT"):
        memory.check_plan(kv, plan, layer_index, vllm_layout)
    with pytest.raises(LayoutMismatch, match="not the arena's layer"):
        memory.check_bound(kv, views, layer_index)


# --- 0.29-0.30: the worker asks the connector ---------------------------------------------------------------------


def test_the_backport_is_installed_only_where_vllm_s_worker_lacks_the_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from vllm.distributed import kv_transfer
    from vllm.v1.worker.gpu_worker import Worker

    monkeypatch.setattr(Worker, "_maybe_get_memory_pool_context", lambda worker, tag: f"vLLM's {tag}")
    original = Worker._maybe_get_memory_pool_context
    try:
        replaced = memory.install_backport()
        assert memory.installed() == replaced
        if memory.has_hook():  # 0.31+: vLLM's own hook, nothing replaced
            assert replaced == [] and Worker._maybe_get_memory_pool_context is original
            return
        assert replaced == ["vllm.v1.worker.gpu_worker.Worker._maybe_get_memory_pool_context"]
        assert memory.install_backport() == replaced  # again: one wrap, not two
        ours = object()
        connector = SimpleNamespace(get_mem_pool_context=lambda: ours)
        monkeypatch.setattr(kv_transfer, "has_kv_transfer_group", lambda: True)
        monkeypatch.setattr(kv_transfer, "get_kv_transfer_group", lambda: connector)
        got = Worker._maybe_get_memory_pool_context(SimpleNamespace(), "kv_cache")
        assert got is ours
        monkeypatch.setattr(connector, "get_mem_pool_context", lambda: None)
        assert Worker._maybe_get_memory_pool_context(SimpleNamespace(), "kv_cache") == "vLLM's kv_cache"
        monkeypatch.setattr(connector, "get_mem_pool_context", lambda: ours)
        assert Worker._maybe_get_memory_pool_context(SimpleNamespace(), "weights") == "vLLM's weights"
    finally:
        memory.uninstall_backport()
    assert Worker._maybe_get_memory_pool_context is original and memory.installed() == []


def test_kv_placement_reports_each_cache_s_offset_into_the_mapped_arena(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool import arena as arenas

    lay = layout()
    kv = arena(lay)
    monkeypatch.setattr(arenas, "_mapped", {("epoch", "handle"): SimpleNamespace(raw=kv.raw, closed=False)})
    outside = torch.zeros(16, dtype=torch.int8)
    worker = SimpleNamespace(model_runner=SimpleNamespace(kv_caches=[kv.layer(2), kv.layer(0), outside]))
    where = memory.kv_placement(worker)
    size = lay.layer_region(BLOCKS, 1)[1]
    assert where["offsets"] == [2 * size, 0, None]
    assert where["replaced"] == memory.installed()


def test_every_name_the_memory_side_relies_on_is_in_this_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The drift test of the memory side: it fails on a vLLM wheel (0.29+) that moved one of them."""
    vllm = pytest.importorskip("vllm")
    if tuple(int(x) for x in vllm.__version__.split(".")[:2]) < (0, 29):
        pytest.skip("this vLLM allocates per layer (before 0.29): kvmemory.py's path")
    assert memory.missing() == []
    from vllm.v1.worker import utils

    monkeypatch.delattr(utils, "allocate_kv_cache")  # as a release that moved it would
    assert memory.missing() == ["vllm.v1.worker.utils.allocate_kv_cache"]


def test_vllm_s_own_worker_allocates_the_kv_inside_the_connector_s_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``Worker.initialize_from_config`` hands the model runner the connector's ``get_mem_pool_context()`` as
    its KV allocation context: by its own hook on 0.31+, through the backport on 0.29-0.30 (and not without it)."""
    vllm = pytest.importorskip("vllm")
    if tuple(int(x) for x in vllm.__version__.split(".")[:2]) < (0, 29):
        pytest.skip("this vLLM allocates per layer (before 0.29): kvmemory.py's path")
    from vllm.distributed import kv_transfer
    from vllm.v1.worker import gpu_worker

    ours = contextlib.nullcontext("the arena's")
    connector = SimpleNamespace(get_mem_pool_context=lambda: ours)
    for module in (gpu_worker, kv_transfer):
        monkeypatch.setattr(module, "has_kv_transfer_group", lambda: True)
        monkeypatch.setattr(module, "get_kv_transfer_group", lambda: connector)
        monkeypatch.setattr(module, "ensure_kv_transfer_initialized", lambda *args, **kw: None)
    vllms = contextlib.nullcontext("vLLM's")
    monkeypatch.setattr(gpu_worker.Worker, "_maybe_get_memory_pool_context", lambda worker, tag: vllms)

    def allocation_context() -> Any:
        got: dict[str, Any] = {}
        worker = gpu_worker.Worker.__new__(gpu_worker.Worker)
        worker.cache_config, worker.vllm_config = SimpleNamespace(), SimpleNamespace()
        worker.model_config = SimpleNamespace(enable_return_routed_experts=False)
        worker.model_runner = SimpleNamespace(initialize_kv_cache=lambda config, **kw: got.update(kw))
        plan = SimpleNamespace(
            num_blocks=BLOCKS, kv_cache_layout=None, hash_block_size=16, cache_hit_alignment_tokens=16,
            needs_kv_cache_zeroing=False,
        )  # fmt: skip
        gpu_worker.Worker.initialize_from_config(worker, plan)
        return got["kv_cache_allocation_context"]

    if not memory.has_hook():
        assert allocation_context() is vllms  # 0.29-0.30 on their own: the connector is not asked
    try:
        memory.install_backport()
        assert allocation_context() is ours
    finally:
        memory.uninstall_backport()


# --- the resident worker side, end to end on the CPU ----------------------------------------------------------------


def resident_worker(raw: torch.Tensor, lay: KVLayout, plan: Any, vllm_layout: str = "LBNHC") -> Any:
    """The connector's resident worker side over ``raw`` as the mapped arena (a stand-in pool client)."""
    from kvpool.integrations.vllm.resident import ResidentWorker

    client = SimpleNamespace(arena=lambda layout, device=None: SimpleNamespace(raw=raw), close=lambda: None)
    descriptor = SimpleNamespace(device=None, arenas=None, layout=lay, num_blocks=BLOCKS)
    return ResidentWorker(client, descriptor, lay, plan, vllm_layout)  # type: ignore[arg-type]


def test_the_resident_worker_side_makes_vllm_s_own_allocation_the_arena(
    no_cuda_pool: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM 0.29+: the connector's worker side, built with vLLM's plan, has vLLM's own ``initialize_from_config`` hand
    the model runner its arena context (on 0.29-0.30 through the backport it installs, on 0.31+ by vLLM's hook);
    vLLM's own ``allocate_kv_cache`` inside that context gets the arena's base, unzeroed, and the views it cuts are
    what the worker side then accepts as the arena's layer regions."""
    lay = layout()
    plan = vllm_plan(lay)
    from vllm.distributed import kv_transfer
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker import gpu_worker
    from vllm.v1.worker.utils import allocate_kv_cache

    kv_raw = torch.zeros(BLOCKS * lay.block_nbytes, dtype=torch.int8)
    vllms = contextlib.nullcontext("vLLM's")
    monkeypatch.setattr(gpu_worker.Worker, "_maybe_get_memory_pool_context", lambda worker, tag: vllms)
    side = resident_worker(kv_raw, lay, plan)
    assert side.runners == []  # no model runner patched
    connector = SimpleNamespace(get_mem_pool_context=side.mem_pool_context)
    for module in (gpu_worker, kv_transfer):
        monkeypatch.setattr(module, "has_kv_transfer_group", lambda: True)
        monkeypatch.setattr(module, "get_kv_transfer_group", lambda: connector)
        monkeypatch.setattr(module, "ensure_kv_transfer_initialized", lambda *args, **kw: None)

    class Allocator(TorchFunctionMode):
        """torch's allocator under the arena's pool: the backing's request is handed the arena's base."""

        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func in (torch.zeros, torch.empty) and args == (memory.kv_bytes(side.kv),):
                self.calls.append(func.__name__)
                assert got["context"].pool.handout.take(arenapool.segment_bytes(args[0]), 0) == kv_raw.data_ptr()
                return kv_raw[: args[0]]
            return func(*args, **(kwargs or {}))

    got: dict[str, Any] = {}
    allocator = Allocator()

    def initialize_kv_cache(config: Any, kv_cache_allocation_context: Any) -> None:
        got["context"] = kv_cache_allocation_context
        with allocator, kv_cache_allocation_context:
            got["views"] = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBNHC, None)

    worker = gpu_worker.Worker.__new__(gpu_worker.Worker)
    worker.cache_config, worker.vllm_config = SimpleNamespace(), SimpleNamespace()
    worker.model_config = SimpleNamespace(enable_return_routed_experts=False)
    worker.model_runner = SimpleNamespace(initialize_kv_cache=initialize_kv_cache)
    plan.kv_cache_layout = None  # the layout stays the one the worker side was built with
    try:
        gpu_worker.Worker.initialize_from_config(worker, plan)
        assert memory.installed() == [name.replace(":", ".") for name in side.generation.REPLACES]
    finally:
        memory.uninstall_backport()
    assert isinstance(got["context"], memory.ArenaContext) and got["context"].arena is side.kv
    assert allocator.calls == ["empty"]  # attaching to a live arena: vLLM's zero fill turned off
    side.register(got["views"])
    assert {name: view.data_ptr() for name, view in got["views"].items()} == {
        name: side.kv.layer(layer_index(name)).data_ptr() for name in got["views"]
    }


def test_the_resident_worker_side_refuses_a_plan_that_is_not_the_arena_before_vllm_allocates() -> None:
    lay = layout()
    plan = vllm_plan(lay)
    plan.num_blocks = BLOCKS + 1
    try:
        with pytest.raises(LayoutMismatch, match=f"--num-gpu-blocks-override {BLOCKS}"):
            resident_worker(torch.zeros(BLOCKS * lay.block_nbytes, dtype=torch.int8), lay, plan)
        assert memory.installed() == []  # refused before the worker was told to ask the connector
    finally:
        memory.uninstall_backport()
