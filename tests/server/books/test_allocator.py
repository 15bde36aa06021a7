"""The allocator alone: exact block order, validation without side effects, and invariants under random use."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.errors import InvalidRequest, NotOwner, PoolExhausted, StaleBlock
from kvpool.ids import GEN_MASK, MAX_ID
from kvpool.server.books.allocator import BlockAllocator


def books(a: BlockAllocator) -> tuple[int, int, int]:
    return a.num_free, a.num_in_use, a.num_cached


def test_fresh_pool_hands_out_ids_in_order_and_reuses_freed_first():
    a = BlockAllocator(8)
    assert a.allocate("s", 3) == [0, 1, 2]
    assert a.free("s", [1]) == 1
    assert a.allocate("s", 2) == [1, 3]
    a.check()


def test_a_reserved_block_is_in_use_for_good_and_never_handed_out():
    a = BlockAllocator([3, 3])
    a.reserve("r", 0)
    a.reserve("r", 3)
    assert books(a) == (4, 2, 0)
    with pytest.raises(InvalidRequest, match="not free"):
        a.reserve("r", 0)
    assert a.allocate("s", 2, 0) == [1, 2] and a.allocate("s", 2, 1) == [4, 5]
    with pytest.raises(PoolExhausted):
        a.allocate("s", 1, 0)
    a.free("s", [1, 2, 4, 5])
    a.check()
    assert a.held("r") == {0: 1, 3: 1}


def test_committed_blocks_are_cached_at_ref_zero_and_evicted_lru_tail_first():
    a = BlockAllocator(4)
    evicted: list[int] = []
    a._on_evict = evicted.append
    ids = a.allocate("s", 4)
    a.mark_committed(ids)
    a.free("s", ids)
    assert books(a) == (0, 0, 4)
    # freed in reverse: the chain's tail (3) is least recent and goes first
    assert a.allocate("t", 2) == [3, 2]
    assert evicted == [3, 2]
    a.check()


def test_referenced_blocks_are_never_evicted():
    a = BlockAllocator(3)
    ids = a.allocate("s", 3)
    a.mark_committed(ids)
    a.free("s", ids[1:])
    a.acquire("u", [2])
    assert a.allocate("t", 1) == [1]
    with pytest.raises(PoolExhausted, match="only 0 of 3"):
        a.allocate("t", 1)
    a.check()


@pytest.mark.parametrize(
    ("ids", "error"),
    [([9], InvalidRequest), ([-1], InvalidRequest), ([0, 0], NotOwner), ([2], NotOwner)],
)
def test_bad_free_changes_nothing(ids, error):
    a = BlockAllocator(4)
    a.allocate("s", 2)
    a.allocate("other", 1)
    before = (books(a), a.held("s"), a.held("other"))
    with pytest.raises(error):
        a.free("s", ids)
    assert (books(a), a.held("s"), a.held("other")) == before
    a.check()


@pytest.mark.parametrize("n", [0, -3, 5])
def test_bad_counts_change_nothing(n):
    a = BlockAllocator(4)
    with pytest.raises((InvalidRequest, PoolExhausted)):
        a.allocate("s", n)
    assert books(a) == (4, 0, 0)


def test_arenas_allocate_from_their_own_range_and_cache():
    a = BlockAllocator([3, 2])
    assert a.allocate("s", 2, arena=1) == [3, 4]
    with pytest.raises(PoolExhausted, match="on arena 1"):
        a.allocate("s", 1, arena=1)
    assert a.allocate("s", 3, arena=0) == [0, 1, 2]
    a.mark_committed([4])
    a.free("s", [3, 4])
    assert a.counts(1) == (1, 0, 1) and a.counts(0) == (0, 3, 0)
    with pytest.raises(InvalidRequest, match="no arena 2"):
        a.allocate("s", 1, arena=2)
    a.check()


def test_transfer_moves_refs_between_holders():
    a = BlockAllocator(4)
    ids = a.allocate("s", 2)
    a.transfer("s", "h", ids)
    assert a.held("s") == {} and a.held("h") == {0: 1, 1: 1}
    with pytest.raises(NotOwner):
        a.transfer("s", "h", ids)
    assert a.release_holder("h") == 2
    assert books(a) == (4, 0, 0)


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "free", "commit", "acquire", "transfer", "release"]),
        st.integers(0, 3),
        st.integers(0, 6),
        st.integers(0, 2**16),
    ),
    max_size=80,
)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from([[12], [5, 7], [3, 4, 5]]))
def test_invariants_hold_under_any_sequence(seq, sizes):
    """Whatever the order of calls, the books balance and each failed call leaves no trace."""
    n = sum(sizes)
    a = BlockAllocator(sizes)
    holders = ["a", "b", "c", "d"]
    for op, h, k, seed in seq:
        holder = holders[h]
        held = [b for b, c in a.held(holder).items() for _ in range(c)]
        pick = [held[(seed >> i) % len(held)] for i in range(min(k, len(held)))] if held else [seed % (n + 2)]
        before = (books(a), {x: a.held(x) for x in holders}, list(a.ref_cnt))
        try:
            if op == "alloc":
                part = seed % len(sizes)
                got = a.allocate(holder, k, part)
                assert all(a.arena_of[b] == part for b in got)
            elif op == "free":
                a.free(holder, pick)
            elif op == "commit":
                a.mark_committed(sorted(set(pick)))
            elif op == "acquire":
                a.acquire(holder, [b for b in range(n) if a.ref_cnt[b] > 0 or a.committed[b]][:k])
            elif op == "transfer":
                a.transfer(holder, holders[(h + 1) % 4], pick)
            else:
                a.release_holder(holder)
        except (InvalidRequest, NotOwner, PoolExhausted):
            assert (books(a), {x: a.held(x) for x in holders}, list(a.ref_cnt)) == before
        a.check()
    for holder in holders:
        a.release_holder(holder)
    a.check()
    assert a.num_in_use == 0
    assert a.num_free + a.num_cached == n


def state(a: BlockAllocator, b: int) -> str:
    return "used" if a.ref_cnt[b] else "cached" if a.committed[b] else "free"


def test_a_freed_id_is_stale_and_its_refusal_changes_nothing():
    a = BlockAllocator(2)
    (block,) = a.allocate("s", 1)
    (fenced,) = a.fenced([block])
    assert fenced == block  # generation 0: a fresh pool's ids are block numbers
    a.free("s", [block])
    (again,) = a.allocate("t", 1)
    assert again == block and a.fenced([again]) == [1 << 32 | block]
    before = (books(a), a.held("t"), list(a.generation))
    with pytest.raises(StaleBlock, match="stale") as refused:
        a.unfence([fenced])
    assert refused.value.stale == (fenced,)
    assert (books(a), a.held("t"), list(a.generation)) == before
    with pytest.raises(InvalidRequest, match="out of range"):
        a.unfence([-1])
    with pytest.raises(InvalidRequest, match="out of range"):
        a.unfence([1 << 63 | block])


def test_the_generation_wraps_within_its_31_bits():
    a = BlockAllocator(1)
    a.fence_of[0] = GEN_MASK << 32  # block 0 at its last generation
    a.allocate("s", 1)
    assert a.fenced([0]) == [GEN_MASK << 32] and a.fenced([0])[0] <= MAX_ID
    a.free("s", [0])
    assert a.generation == [0]


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(ops, st.sampled_from([[6], [3, 4]]))
def test_generations_fence_exactly_the_ids_whose_blocks_were_recycled(seq, sizes):
    """A block's generation moves (by one) exactly when its content ends: it goes back to the free stack, or is
    evicted from the cache for a new owner. So an id is accepted while what it was handed out for lasts, refused
    after, and an id once refused is never handed out again (until the generation wraps, 2**31 reuses later)."""
    n = sum(sizes)
    a = BlockAllocator(sizes)
    holders = ["a", "b", "c", "d"]
    issued: set[int] = set()  # every fenced id ever handed out
    retired: set[int] = set()  # ids whose block's generation has moved on since
    for op, h, k, seed in seq:
        holder = holders[h]
        held = [b for b, c in a.held(holder).items() for _ in range(c)]
        pick = [held[(seed >> i) % len(held)] for i in range(min(k, len(held)))] if held else [seed % n]
        states = [state(a, b) for b in range(n)]
        gens = list(a.generation)
        try:
            if op == "alloc":
                got = a.fenced(a.allocate(holder, k, seed % len(sizes)))
                assert not retired & set(got), "a recycled block was handed out under an id already refused"
                issued.update(got)
            elif op == "free":
                a.free(holder, a.unfence(a.fenced(pick)))
            elif op == "commit":
                a.mark_committed(sorted(set(pick)))
            elif op == "acquire":
                shared = [b for b in range(n) if a.ref_cnt[b] > 0 or a.committed[b]][:k]
                a.acquire(holder, shared)
                issued.update(a.fenced(shared))
            elif op == "transfer":
                a.transfer(holder, holders[(h + 1) % 4], pick)
            else:
                a.release_holder(holder)
        except (InvalidRequest, NotOwner, PoolExhausted):
            assert a.generation == gens, "a refused call moved a generation"
        for b in range(n):
            before, after = states[b], state(a, b)
            evicted = before == "cached" and after == "used" and not a.committed[b]
            ended = (before != "free" and after == "free") or evicted
            assert a.generation[b] == (gens[b] + ended) & GEN_MASK, f"block {b}: {before} -> {after}"
            if ended:
                retired.add(gens[b] << 32 | b)
        for b in range(n):  # what anyone holds, or the cache keeps, is still named by the ids it was handed out as
            if state(a, b) != "free":
                assert a.unfence(a.fenced([b])) == [b]
        for stale in retired:
            with pytest.raises(StaleBlock):
                a.unfence([stale])
        assert retired <= issued, "a generation moved for a block nobody was handed"
        a.check()


def test_spare_blocks_are_evicted_first_oldest_first_and_the_others_after():
    a = BlockAllocator(6)
    ids = a.allocate("s", 6)
    a.mark_committed(ids)
    a.set_spare([ids[4], ids[1]], True)  # marked while in use: they go to the spares' LRU when freed
    a.free("s", ids)  # freed in reverse: the LRU's oldest is ids[5]
    a.check()
    assert books(a) == (0, 0, 6)
    assert a.allocate("t", 3) == [ids[4], ids[1], ids[5]]  # the spares first (oldest first), then the LRU's oldest
    a.set_spare([ids[3]], True)  # a cached block that becomes spare moves to the spares' LRU
    assert a.allocate("t", 1) == [ids[3]]
    assert not any(a.spare[b] for b in a.held("t"))  # an evicted block is no one's copy any more
    a.check()


# The two properties above for ``-m "not slow"``: a few examples each, where the whole suite runs the 300 as well.
test_invariants_hold_in_a_few_sequences = settings(max_examples=30, deadline=None)(
    given(ops, st.sampled_from([[12], [5, 7], [3, 4, 5]]))(
        test_invariants_hold_under_any_sequence.hypothesis.inner_test
    )
)
test_generations_fence_in_a_few_sequences = settings(max_examples=30, deadline=None)(
    given(ops, st.sampled_from([[6], [3, 4]]))(
        test_generations_fence_exactly_the_ids_whose_blocks_were_recycled.hypothesis.inner_test
    )
)
