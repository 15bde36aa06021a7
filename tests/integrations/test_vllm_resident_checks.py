"""Resident mode's start-up decisions, without vLLM or a GPU: when an engine falls back to copy mode (one line
saying why) and when it refuses to start (naming the flag)."""

from __future__ import annotations

import pytest

from kvpool.errors import LayoutMismatch
from kvpool.integrations.vllm import resident
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor, ArenaPart, DeviceInfo

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="bfloat16", order="kv_packed")
GPU = DeviceInfo(index=0, uuid="GPU-aaaa", name="H")


def pool(**fields: object) -> ArenaDescriptor:
    base: dict[str, object] = dict(
        epoch="e", backend="cuda", device=GPU, handle="vmm:0", handle_kind="vmm", nbytes=LAYOUT.block_nbytes * 64,
        num_blocks=64, block_nbytes=LAYOUT.block_nbytes, layout=LAYOUT, owner_pid=1, slab_slots=64,
        arenas=[ArenaPart(index=0, device=GPU, handle="vmm:0", nbytes=LAYOUT.block_nbytes * 64, num_blocks=64)],
    )  # fmt: skip
    return ArenaDescriptor(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "uuid", "groups", "why"),
    [
        ({"backend": "cpu", "device": None, "arenas": []}, "GPU-aaaa", 1, "--backend cpu"),
        ({}, "GPU-bbbb", 1, "no arena of the pool is on this engine's GPU"),
        ({"layout": LAYOUT.model_copy(update={"order": "layer_major"})}, "GPU-aaaa", 1, "--order kv_packed"),
        ({"slab_slots": 0}, "GPU-aaaa", 1, "--slabs"),
        ({}, "GPU-aaaa", 2, "2 KV cache groups"),
    ],
)
def test_an_engine_that_cannot_be_resident_is_told_why(fields: dict, uuid: str, groups: int, why: str) -> None:
    got = resident.why_not(pool(**fields), uuid, groups)
    assert got is not None and why in got


def test_an_engine_that_could_be_resident_is_held_back_only_by_its_vllm() -> None:
    got = resident.why_not(pool(), "GPU-aaaa", 1)
    if resident.missing_hooks() is None:
        assert got is None
    else:  # no vLLM here: its allocation points are what is missing
        assert got is not None and got.startswith("this vLLM has no")


def test_the_arena_on_the_engine_s_gpu_is_the_one_it_maps() -> None:
    other = DeviceInfo(index=1, uuid="GPU-bbbb", name="H")
    two = pool(arenas=[
        ArenaPart(index=0, device=GPU, handle="vmm:0", nbytes=1, num_blocks=64),
        ArenaPart(index=1, device=other, handle="vmm:1", nbytes=1, num_blocks=32, first_block=64),
    ])  # fmt: skip
    part = resident.arena_on(two, "GPU-bbbb")
    assert part is not None and (part.num_blocks, part.first_block, part.device) == (32, 64, other)
    assert resident.arena_on(two, "GPU-cccc") is None


def test_a_setting_that_differs_refuses_to_start_naming_the_flag() -> None:
    with pytest.raises(LayoutMismatch, match="--num-gpu-blocks-override 64"):
        resident.check_geometry(pool(), LAYOUT.model_copy(update={"order": "layer_major"}), 4096)
    with pytest.raises(LayoutMismatch, match="not the pool's"):
        resident.check_geometry(pool(), LAYOUT.model_copy(update={"head_dim": 16}), 64)
    resident.check_geometry(pool(), LAYOUT.model_copy(update={"order": "layer_major"}), 64)
