"""Which of a torch pool's allocations becomes the arena (kvpool/integrations/vllm/arenapool.py), on the CPU: the
books alone; tests/gpu/test_vllm_memory.py runs the pool on a GPU."""

from __future__ import annotations

from kvpool.integrations.vllm import arenapool

MiB = 1 << 20


def test_segment_bytes_is_what_torch_s_caching_allocator_asks_a_pool_for() -> None:
    assert arenapool.segment_bytes(1) == 2 * MiB
    assert arenapool.segment_bytes(MiB) == 2 * MiB
    assert arenapool.segment_bytes(MiB + 1) == 20 * MiB
    assert arenapool.segment_bytes(10 * MiB) == 10 * MiB
    assert arenapool.segment_bytes(10 * MiB + 1) == 12 * MiB


def test_the_arena_goes_once_to_the_kv_backing_on_its_device_and_to_nothing_else() -> None:
    kv = 11 * MiB + 300
    h = arenapool.Handout(base=0x7000, device=1, kv_bytes=kv, mapped=12 * MiB)
    assert h.take(2 * MiB, 1) is None  # a small tensor allocated in the context
    assert h.take(12 * MiB, 0) is None  # the right size on another device
    assert h.missed() is not None
    assert h.take(12 * MiB, 1) == 0x7000  # the segment torch asks for the KV backing
    assert h.take(12 * MiB, 1) is None  # never twice
    assert h.missed() is None


def test_a_kv_backing_larger_than_the_arena_s_span_is_not_given_the_arena_and_the_miss_says_why() -> None:
    kv = 11 * MiB + 300
    h = arenapool.Handout(base=0x7000, device=0, kv_bytes=kv, mapped=12 * MiB)
    assert h.take(14 * MiB, 0) is None  # an engine with more blocks than the arena
    why = h.missed()
    assert why is not None and str(14 * MiB) in why and "--num-gpu-blocks-override" in why


def test_a_small_arena_takes_torch_s_fixed_segment() -> None:
    h = arenapool.Handout(base=0x7000, device=0, kv_bytes=3 * MiB, mapped=4 * MiB)
    assert h.take(20 * MiB, 0) == 0x7000  # below 10 MiB torch asks for a 20 MiB segment; the pool never splits it
