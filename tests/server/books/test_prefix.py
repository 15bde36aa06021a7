"""Prefix hashing and the prefix cache: chains, sharing, collisions, and a model-based test against a reference."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import pytest
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.errors import InvalidRequest, PoolExhausted
from kvpool.ids import block_of
from kvpool.layout import KVLayout
from kvpool.server.books.pool import Pool
from kvpool.server.books.prefix import DIGESTS, PrefixHasher, salt_tag, token_bytes

BS = 4


def make_pool(num_blocks: int = 16, digest=None) -> Pool:
    return Pool(num_blocks, KVLayout(block_size=BS), digest=digest)


def test_hashes_chain_over_full_blocks_and_namespace():
    h = PrefixHasher("ns", BS)
    a = h.block_hashes(list(range(10)))
    assert len(a) == 2  # the partial third block is not hashed
    assert h.block_hashes(list(range(8))) == a
    assert h.block_hashes([0, 1, 2, 3, 9, 9, 9, 9])[0] == a[0]
    assert h.block_hashes([0, 1, 2, 3, 9, 9, 9, 9])[1] != a[1]
    assert PrefixHasher("other-model", BS).block_hashes(list(range(8)))[0] != a[0]
    root = xxhash.xxh3_128_digest(b"ns")
    assert a[0] == xxhash.xxh3_128_digest(root + token_bytes([0, 1, 2, 3]))


def test_token_ids_out_of_range_are_refused():
    with pytest.raises(InvalidRequest, match="2\\*\\*32"):
        token_bytes([1, -1])
    with pytest.raises(InvalidRequest):
        token_bytes([2**32])


def test_lookup_shares_exactly_the_common_full_blocks():
    pool = make_pool()
    a = pool.open_session("a", "prefill").session_id
    b = pool.open_session("b", "prefill").session_id
    prompt = list(range(100, 114))  # 3 full blocks + 2 tokens
    ids = pool.alloc(a, 4)
    assert pool.commit(a, ids, prompt).committed == 3
    other = [*prompt[:8], 7, 7, 7, 7, 7]
    hit = pool.lookup(b, other)
    assert hit.block_ids == ids[:2] and hit.num_tokens == 8
    assert pool.allocator.ref_cnt[ids[0]] == 2
    pool.free(a, ids)
    pool.free(b, hit.block_ids)
    assert pool.stats()["cached"] == 3 and pool.stats()["free"] == 13


def test_committing_known_content_again_is_a_duplicate_not_a_second_entry():
    pool = make_pool()
    a = pool.open_session("a", "prefill").session_id
    prompt = list(range(8))
    first, second = pool.alloc(a, 2), pool.alloc(a, 2)
    pool.commit(a, first, prompt)
    r = pool.commit(a, second, prompt)
    assert (r.committed, r.duplicates) == (0, 2)
    pool.free(a, second)
    assert pool.stats()["free"] == 14  # duplicates go back to free, not to the cache


def test_commit_validates_before_changing_anything():
    pool = make_pool()
    a = pool.open_session("a", "prefill").session_id
    b = pool.open_session("b", "prefill").session_id
    ids = pool.alloc(a, 2)
    theirs = pool.alloc(b, 1)
    for bad_ids, tokens in [
        (ids[:1], list(range(8))),
        ([ids[0], ids[0]], list(range(8))),
        ([ids[0], *theirs], list(range(8))),
    ]:
        with pytest.raises(Exception):  # noqa: B017 - each is a 4xx kind; the point is no state change
            pool.commit(a, bad_ids, tokens)
        assert len(pool.index) == 0
    pool.commit(a, ids, list(range(8)))
    with pytest.raises(InvalidRequest, match="other tokens"):
        pool.commit(a, ids, [9] * 8)


def test_a_commit_past_a_prefix_the_pool_holds_goes_on_from_it_and_lets_go():
    pool = make_pool()
    a = pool.open_session("a", "prefill").session_id
    b = pool.open_session("b", "prefill").session_id
    prompt = list(range(100, 116))  # 4 full blocks
    ids = pool.alloc(a, 2)
    pool.commit(a, ids, prompt[:8], release=True)
    assert pool.stats()["cached"] == 2 and pool.stats()["in_use"] == 0
    tail = pool.alloc(b, 2)
    r = pool.commit(b, tail, prompt, start=2, release=True)
    assert (r.committed, r.duplicates, r.num_blocks, r.missing) == (2, 0, 4, 0)
    assert pool.stats()["in_use"] == 0 and pool.stats()["cached"] == 4
    hit = pool.lookup(a, prompt)
    assert hit.block_ids == ids + tail and hit.num_tokens == 16


def test_a_commit_past_a_prefix_the_pool_no_longer_holds_commits_nothing():
    pool = make_pool(num_blocks=4)
    a = pool.open_session("a", "prefill").session_id
    prompt = list(range(100, 116))
    pool.commit(a, pool.alloc(a, 2), prompt[:8], release=True)
    pool.free(a, pool.alloc(a, 3))  # evicts one cached block of the prefix
    tail = pool.alloc(a, 2)
    r = pool.commit(a, tail, prompt, start=2, release=True)
    assert r.committed == 0 and r.missing in (1, 2)
    assert pool.stats()["in_use"] == 0 and pool.stats()["cached"] == 1  # the tail went back to free
    assert pool.lookup(a, prompt).num_tokens <= 4


def test_a_commit_past_a_prefix_is_checked_before_anything_changes():
    pool = make_pool()
    a = pool.open_session("a", "prefill").session_id
    ids = pool.alloc(a, 2)
    for start, given in [(4, ids[:1]), (1, ids[:1])]:  # past the 3 full blocks; one id short of blocks 1-2
        with pytest.raises(InvalidRequest):
            pool.commit(a, given, list(range(12)), start=start, release=True)
    assert len(pool.index) == 0 and pool.stats()["in_use"] == 2


def weak_digest(data: bytes) -> bytes:
    """A 4-bit hash: almost every pair of blocks collides."""
    return bytes([xxhash.xxh3_64_digest(data)[0] & 0x0F])


def test_forced_collisions_never_share_a_block_across_different_tokens():
    pool = make_pool(num_blocks=64, digest=weak_digest)
    s = pool.open_session("a", "prefill").session_id
    rng = __import__("random").Random(7)
    seqs = [[rng.randrange(2) for _ in range(BS * 3)] for _ in range(60)]
    owner: dict[int, tuple[int, ...]] = {}
    for seq in seqs:
        hit = pool.lookup(s, seq)
        for i, block in enumerate(hit.block_ids):
            assert owner[block] == tuple(seq[: (i + 1) * BS]), "a hit handed back KV of other tokens"
        new = pool.alloc(s, 3 - len(hit.block_ids))
        blocks = hit.block_ids + new
        pool.commit(s, blocks, seq)
        for i, block in enumerate(new, start=len(hit.block_ids)):
            owner[block] = tuple(seq[: (i + 1) * BS])
        pool.free(s, blocks)
    assert pool.counters.hit_blocks > 0  # collisions did not switch the cache off either


def test_sha256_chains_are_sha256_over_the_same_bytes():
    h = PrefixHasher("ns", BS, DIGESTS["sha256"])
    tokens = list(range(8))
    key = hashlib.sha256(b"ns").digest()
    expected = []
    for i in range(2):
        key = hashlib.sha256(key + token_bytes(tokens[i * BS : (i + 1) * BS])).digest()
        expected.append(key)
    assert h.block_hashes(tokens) == expected
    assert PrefixHasher("ns", BS).block_hashes(tokens) != expected  # xxh3, the default, is another chain


def test_salt_tags_tell_every_salt_apart():
    tags = [salt_tag(s) for s in (None, "a", "ab", "a\0", "é", "\ud800")]
    assert tags[0] == b"" and salt_tag("") == b"" and len(set(tags)) == len(tags)


def test_salted_chains_differ_from_the_first_block_on():
    h = PrefixHasher("ns", BS)
    tokens = list(range(3 * BS))
    plain, a, b = h.block_hashes(tokens), h.block_hashes(tokens, "tenant-a"), h.block_hashes(tokens, "tenant-b")
    assert all(len({x, y, z}) == 3 for x, y, z in zip(plain, a, b, strict=True))
    assert h.block_hashes(tokens, "tenant-a") == a


@pytest.mark.parametrize("digest", [None, DIGESTS["sha256"], weak_digest], ids=["xxh3", "sha256", "colliding"])
def test_salted_chains_never_share_blocks_with_other_salts_or_none(digest):
    """Even where every key collides (a 4-bit hash), a lookup finds only blocks committed with its own salt: the
    salt is kept with the first block's node and compared, not only hashed."""
    pool = make_pool(num_blocks=32, digest=digest)
    s = pool.open_session("a", "prefill").session_id
    prompt = [1] * (2 * BS)
    committed = {}
    for salt in (None, "tenant-a", "tenant-b", "lora:x"):
        assert pool.lookup(s, prompt, salt=salt).block_ids == [], f"{salt!r} found another salt's blocks"
        ids = pool.alloc(s, 2)
        assert pool.commit(s, ids, prompt, salt=salt).committed == 2
        committed[salt] = ids
    for salt, ids in committed.items():
        hit = pool.lookup(s, [*prompt, 2], salt=salt)
        if digest is weak_digest:  # a key taken over by another chain costs a miss, never a wrong hit
            assert hit.block_ids == ids[: len(hit.block_ids)]
        else:
            assert hit.block_ids == ids and hit.num_tokens == 2 * BS
        pool.free(s, hit.block_ids)
    assert pool.lookup(s, prompt, salt="tenant-c").block_ids == []


# -- model-based test ------------------------------------------------------------------------------------

SEQS = [[1] * 12 + [2] * 8, [1] * 12 + [3] * 8, [1] * 4 + [5] * 16, [7] * 20, [1] * 8 + [2] * 12]


@dataclass
class RefNode:
    block: int
    parent: int | None  # serial of the parent node
    serial: int


class Reference:
    """The cache's intended behaviour in the plainest code: tuples for hashes, lists for everything."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.refs = [0] * n
        self.free = list(range(n - 1, -1, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.nodes: dict[tuple[int, ...], RefNode] = {}
        self.node_of: dict[int, tuple[int, ...]] = {}
        self.serial = 0

    def alloc(self, k: int) -> list[int]:
        if k > len(self.free) + len(self.lru):
            raise PoolExhausted("")
        out = []
        for _ in range(k):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                prefix = self.node_of.pop(b)
                if self.nodes.get(prefix) is not None and self.nodes[prefix].block == b:
                    del self.nodes[prefix]
            self.refs[b] = 1
            out.append(b)
        return out

    def lookup(self, tokens: list[int]) -> list[int]:
        out, prev = [], None
        for i in range(len(tokens) // BS):
            node = self.nodes.get(tuple(tokens[: (i + 1) * BS]))
            if node is None or node.parent != prev:
                break
            out.append(node.block)
            prev = node.serial
        for b in out:
            if self.refs[b] == 0:
                del self.lru[b]
            self.refs[b] += 1
        return out

    def commit(self, blocks: list[int], tokens: list[int]) -> None:
        prev = None
        for i, b in enumerate(blocks[: len(tokens) // BS]):
            prefix = tuple(tokens[: (i + 1) * BS])
            node = self.nodes.get(prefix)
            if node is not None and node.parent == prev:
                prev = node.serial
                continue
            self.serial += 1
            self.nodes[prefix] = RefNode(b, prev, self.serial)
            self.node_of[b] = prefix
            prev = self.serial

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.node_of:
                    self.lru[b] = None
                else:
                    self.free.append(b)


def blocks_of(ids: list[int]) -> list[int]:
    return [block_of(i) for i in ids]


class PrefixCacheMachine(RuleBasedStateMachine):
    N = 10

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(self.N)
        self.ref = Reference(self.N)
        self.sessions = [self.pool.open_session(f"s{i}", "prefill").session_id for i in range(3)]
        self.held: list[tuple[int, list[int]]] = []  # (session index, blocks of one request)
        self.owned: list[dict[int, int]] = [{} for _ in range(3)]  # refs per session, in first-taken order

    def _take(self, s: int, blocks: list[int]) -> None:
        for b in blocks:
            self.owned[s][b] = self.owned[s].get(b, 0) + 1

    def _drop(self, s: int, blocks: list[int]) -> None:
        for b in blocks:
            self.owned[s][b] -= 1
            if not self.owned[s][b]:
                del self.owned[s][b]

    @rule(s=st.integers(0, 2), seq=st.integers(0, len(SEQS) - 1), length=st.integers(1, 20))
    def request(self, s, seq, length):
        tokens = SEQS[seq][:length]
        sid = self.sessions[s]
        hit = self.pool.lookup(sid, tokens).block_ids  # fenced ids: the reference knows blocks
        assert blocks_of(hit) == self.ref.lookup(tokens)
        need = -(-length // BS) - len(hit)
        try:
            new = self.pool.alloc(sid, need) if need else []
        except PoolExhausted:
            with pytest.raises(PoolExhausted):
                self.ref.alloc(need)
            self.pool.free(sid, hit)
            self.ref.release(blocks_of(hit))
            return
        assert blocks_of(new) == self.ref.alloc(need), "allocation or eviction order differs from LRU"
        self.pool.commit(sid, hit + new, tokens)
        self.ref.commit(blocks_of(hit + new), tokens)
        self.held.append((s, hit + new))
        self._take(s, blocks_of(hit + new))

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        s, blocks = self.held.pop(i % len(self.held))
        self.pool.free(self.sessions[s], blocks)
        self.ref.release(blocks_of(blocks))
        self._drop(s, blocks_of(blocks))

    @rule(s=st.integers(0, 2))
    def close(self, s):
        self.pool.close_session(self.sessions[s])
        self.ref.release([b for b, count in self.owned[s].items() for _ in range(count)])
        self.owned[s] = {}
        self.held = [h for h in self.held if h[0] != s]
        self.sessions[s] = self.pool.open_session(f"s{s}", "prefill").session_id

    @invariant()
    def books_balance_and_match_the_reference(self):
        a = self.pool.allocator
        a.check()
        assert a.num_free + a.num_in_use + a.num_cached == self.N
        assert (a.num_free, a.num_cached) == (len(self.ref.free), len(self.ref.lru))
        for _, blocks in self.held:
            for b in blocks:
                assert a.ref_cnt[block_of(b)] > 0, "a referenced block was evicted"
                assert a.fenced([block_of(b)]) == [b], "a held block's generation changed"


class test_prefix_cache_matches_reference(PrefixCacheMachine.TestCase):
    pytestmark = pytest.mark.slow
    settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class test_prefix_cache_matches_reference_in_a_few_runs(PrefixCacheMachine.TestCase):
    """The same machine for ``-m "not slow"``: a few runs, where the whole suite runs the 150 above as well."""

    settings = settings(max_examples=15, stateful_step_count=40, deadline=None)
