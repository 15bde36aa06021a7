"""Content-addressed prefix blocks: xxh3 hash chains and the index that maps them to blocks.

A block's key is ``xxh3_128(key of the previous block || the block's token ids)``, and the first block's parent
is a digest of a namespace that names the model and layout, so two models never share KV. Only full blocks are
hashed. Anyone holding the namespace can compute the same keys from token ids (:meth:`PrefixHasher.block_hashes`).

A hash is only an index, never a proof: each indexed node keeps its block's token ids and its parent *node*,
and a lookup accepts a node only if both match exactly what it walked through. By induction a hit's whole
prefix equals the query's, so a hash collision (accidental or crafted) costs a cache miss and never hands out
KV of other tokens.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import xxhash

from kvpool.errors import InvalidRequest

Digest = Callable[[bytes], bytes]


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (the hashed and stored form)."""
    try:
        arr = array("I", token_ids)
    except (OverflowError, TypeError) as exc:
        raise InvalidRequest(f"token ids must be integers in [0, 2**32): {exc}") from None
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


class PrefixHasher:
    """Computes the block keys of a token sequence for one namespace and block size."""

    def __init__(self, namespace: str, block_size: int, digest: Digest = xxhash.xxh3_128_digest) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.digest = digest
        self.root = digest(namespace.encode())

    def block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Keys of the full blocks of ``token_ids``, one per block."""
        return [key for key, _ in self.blocks(token_ids)]

    def blocks(self, token_ids: Sequence[int]) -> Iterator[tuple[bytes, bytes]]:
        """(key, token bytes) of each full block, computed lazily so that a lookup stops paying at its first miss."""
        data = token_bytes(token_ids)
        step = self.block_size * 4
        digest, key = self.digest, self.root
        for off in range(0, len(data) - step + 1, step):
            chunk = data[off : off + step]
            key = digest(key + chunk)
            yield key, chunk


class _Node:
    __slots__ = ("block", "key", "parent", "tokens")

    def __init__(self, key: bytes, block: int, tokens: bytes, parent: _Node | None) -> None:
        self.key = key
        self.block = block
        self.tokens = tokens
        self.parent = parent


class IndexListener(Protocol):
    """Told of every change to which keys the index finds (what a router mirrors: see server/kvevents.py)."""

    def stored(self, nodes: Sequence[_Node]) -> None:
        """``nodes`` became findable: one chain, each node's parent the one before it (the first's may be None)."""

    def removed(self, node: _Node) -> None:
        """``node``'s key is findable no more."""


class PrefixIndex:
    """Maps block keys to cached blocks, verified against token ids and parent identity."""

    def __init__(self, listener: IndexListener | None = None) -> None:
        self._nodes: dict[bytes, _Node] = {}
        self._by_block: dict[int, _Node] = {}
        self.listener = listener

    def __len__(self) -> int:
        return len(self._by_block)

    def findable(self) -> Iterator[_Node]:
        """The nodes a key finds (a node whose key another took over is cached but no longer findable)."""
        return iter(self._nodes.values())

    def match(self, blocks: Iterable[tuple[bytes, bytes]]) -> list[int]:
        """Blocks of the longest verified prefix of ``blocks`` ((key, token bytes) pairs, in order)."""
        nodes, prev, out = self._nodes, None, []
        for key, chunk in blocks:
            node = nodes.get(key)
            if node is None or node.parent is not prev or node.tokens != chunk:
                break
            out.append(node.block)
            prev = node
        return out

    def plan(self, blocks: Iterable[tuple[bytes, bytes]], block_ids: Sequence[int]) -> list[_Node]:
        """Check a commit without changing anything; return the nodes :meth:`apply` would add.

        A block whose content is already indexed (the same tokens after the same parent) is a duplicate: it is
        not indexed again, and the chain goes on from the indexed node, as vLLM does. A key held by another
        node (a collision, or an orphan whose parent was evicted) is taken over by the new node: that costs at
        most a miss on the other chain, and never a wrong hit.
        """
        nodes, by_block, prev = self._nodes, self._by_block, None
        new: list[_Node] = []
        pairs = zip(blocks, block_ids, strict=True)
        for (key, chunk), block in pairs:
            node = nodes.get(key)
            if node is not None and node.parent is prev and node.tokens == chunk:
                owner = by_block.get(block)
                if owner is not None and owner is not node:
                    raise InvalidRequest(
                        f"block {block} already holds cached KV of other tokens: commit only blocks you wrote"
                    )
                prev = node
                continue
            if block in by_block:
                raise InvalidRequest(
                    f"block {block} already holds cached KV of other tokens: commit only blocks you wrote"
                )
            prev = _Node(key, block, chunk, prev)
            new.append(prev)
            break
        # Past the first new node no indexed node can follow (its parent would be a node not yet indexed), so the
        # rest of the chain is new: only a block that already holds other cached KV stops it.
        for (key, chunk), block in pairs:
            if block in by_block:
                raise InvalidRequest(
                    f"block {block} already holds cached KV of other tokens: commit only blocks you wrote"
                )
            prev = _Node(key, block, chunk, prev)
            new.append(prev)
        return new

    def apply(self, new: Sequence[_Node]) -> None:
        for node in new:
            self._nodes[node.key] = node
            self._by_block[node.block] = node
        if new and self.listener is not None:
            self.listener.stored(new)

    def remove_block(self, block: int) -> None:
        node = self._by_block.pop(block, None)
        if node is not None and self._nodes.get(node.key) is node:
            del self._nodes[node.key]
            if self.listener is not None:
                self.listener.removed(node)
