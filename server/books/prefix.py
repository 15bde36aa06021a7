"""Content-addressed prefix blocks: hash chains (xxh3 or sha256) and the index that maps them to blocks.

A block's key is ``H(key of the previous block || the block's token ids)``, and the first block's parent is a
digest of a namespace that names the model and layout, so two models never share KV. Only full blocks are hashed.
Anyone holding the namespace can compute the same keys from token ids (:meth:`PrefixHasher.block_hashes`). ``H``
is xxh3-128 by default; sha256 (``--prefix-hash sha256``, vLLM's default since 0.10.2) costs more per block but no
one can craft a collision with it, which matters where tenants who do not trust each other share a pool.

A request may carry a *salt* (a tenant, a LoRA adapter): it is mixed into the first block, ``H(root || salt tag ||
tokens)``, and kept with the first block's node, so chains of different salts (or none) never share a block.

A hash is only an index, never a proof: each indexed node keeps its block's token ids and its parent *node*,
and a lookup accepts a node only if both match exactly what it walked through. By induction a hit's whole
prefix equals the query's, so a hash collision (accidental or crafted) costs a cache miss and never hands out
KV of other tokens.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import xxhash

from kvpool.errors import InvalidRequest
from kvpool.tokens import U32

Digest = Callable[[bytes], bytes]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


#: the prefix hashes a pool can use, by their setting's name (``--prefix-hash``)
DIGESTS: dict[str, Digest] = {"xxh3": xxhash.xxh3_128_digest, "sha256": _sha256}
MAX_SALT = 256


def salt_tag(salt: str | None) -> bytes:
    """What a salt adds before the first block's tokens: its length and its UTF-8 bytes (nothing without one), so
    that no two salts, and no salt and none, give the same bytes."""
    if not salt:
        return b""
    raw = salt.encode("utf-8", "surrogatepass")
    return struct.pack("<I", len(raw)) + raw


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (the hashed and stored form)."""
    if type(token_ids) is array and token_ids.typecode == U32 and sys.byteorder == "little":
        return token_ids.tobytes()  # packed on the wire (``tokens``): already that form
    try:
        arr = array(U32, token_ids)
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

    def block_hashes(self, token_ids: Sequence[int], salt: str | None = None) -> list[bytes]:
        """Keys of the full blocks of ``token_ids``, one per block."""
        return [key for key, _ in self.blocks(token_ids, salt)]

    def blocks(self, token_ids: Sequence[int], salt: str | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(key, token bytes) of each full block, computed lazily so that a lookup stops paying at its first miss.

        With a salt, the first block's bytes start with its tag: hashed, and kept and compared by the index.
        """
        data = token_bytes(token_ids)
        step = self.block_size * 4
        digest, key = self.digest, self.root
        tag = salt_tag(salt)
        for off in range(0, len(data) - step + 1, step):
            chunk = data[off : off + step]
            if tag:
                chunk, tag = tag + chunk, b""
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
    """Told of every change to which keys the index finds (what a router mirrors: see server/events/kvevents.py)."""

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
        return [node.block for node in self.match_nodes(blocks)]

    def match_nodes(self, blocks: Iterable[tuple[bytes, bytes]]) -> list[_Node]:
        """Nodes of the longest verified prefix of ``blocks``: each found by its key, with the tokens and the parent
        node it was walked to with (a node whose block went to the host tier included)."""
        nodes, prev, out = self._nodes, None, []
        for key, chunk in blocks:
            node = nodes.get(key)
            if node is None or node.parent is not prev or node.tokens != chunk:
                break
            out.append(node)
            prev = node
        return out

    def tail(self, blocks: Iterable[tuple[bytes, bytes]]) -> tuple[_Node | None, int]:
        """The last node of ``blocks`` if every one of them is indexed (verified as :meth:`match_nodes` verifies),
        and how many were not (0, or all from the first missing one on)."""
        pairs = list(blocks)
        found = self.match_nodes(pairs)
        if len(found) < len(pairs):
            return None, len(pairs) - len(found)
        return (found[-1] if found else None), 0

    def plan(
        self, blocks: Iterable[tuple[bytes, bytes]], block_ids: Sequence[int], parent: _Node | None = None
    ) -> list[_Node]:
        """Check a commit without changing anything; return the nodes :meth:`apply` would add.

        A block whose content is already indexed (the same tokens after the same parent) is a duplicate: it is
        not indexed again, and the chain goes on from the indexed node, as vLLM does. A key held by another
        node (a collision, or an orphan whose parent was evicted) is taken over by the new node: that costs at
        most a miss on the other chain, and never a wrong hit. ``parent``: the indexed node the chain goes on from,
        for a commit past a prefix the index holds.
        """
        nodes, by_block, prev = self._nodes, self._by_block, parent
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
