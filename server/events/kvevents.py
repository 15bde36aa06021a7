"""KV events in the wire format vLLM publishes, so that a KV-aware router indexes a pool as it indexes a vLLM.

vLLM (``vllm/distributed/kv_events.py``, release 0.26) sends each batch as msgpack: the batch is an array
``[ts, events, data_parallel_rank]`` and each event a map tagged by ``"type"``, with the fields in this order:

* ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium``,
  ``lora_name`` (the optional fields after them are left out, as its encoder omits defaults);
* ``BlockRemoved``: ``block_hashes``, ``medium``;
* ``AllBlocksCleared``: no field.

Earlier vLLM releases sent each event as an array, its tag first and its fields by position; ``array`` picks that
form for subscribers written against them. A block hash is the pool's prefix key: by default as vLLM sends it
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), the key's last 8 bytes as an unsigned big-endian integer; ``bytes``
sends the whole key. The data-parallel rank is the arena's index: a block on one GPU serves only that GPU's worker.
"""

from __future__ import annotations

import sys
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any, Literal

from kvpool.server.books.prefix import _Node

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

HashForm = Literal["int", "bytes"]
EventForm = Literal["map", "array"]

#: an event as the pool's event loop hands it over, before any conversion (done on the publisher's thread):
#: ("stored", keys, parent key, token bytes, block size, medium) | ("removed", keys, medium) | ("cleared",)
RawEvent = tuple[Any, ...]

_MASK64 = (1 << 64) - 1


def external_hash(key: bytes, form: HashForm = "int") -> int | bytes:
    """A prefix key as events carry it: vLLM's ``maybe_convert_block_hash`` on the key's bytes, or the bytes."""
    return int.from_bytes(key, "big") & _MASK64 if form == "int" else key


def rank_of(starts: Sequence[int], block: int) -> int:
    """The arena (the events' data-parallel rank) of a block, from the arenas' first block ids."""
    return bisect_right(starts, block) - 1


def token_list(data: bytes) -> list[int]:
    tokens = array("I", data)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens.tolist()


def encode_event(raw: RawEvent, hashes: HashForm = "int", form: EventForm = "map") -> Any:
    """One event as msgpack-ready data (dicts keep their order, which msgpack keeps on the wire)."""
    kind = raw[0]
    if kind == "stored":
        _, keys, parent, tokens, block_size, medium = raw
        fields: dict[str, Any] = {
            "block_hashes": [external_hash(k, hashes) for k in keys],
            "parent_block_hash": None if parent is None else external_hash(parent, hashes),
            "token_ids": token_list(tokens),
            "block_size": block_size,
            "lora_id": None,
            "medium": medium,
            "lora_name": None,
        }
        tag = "BlockStored"
    elif kind == "removed":
        _, keys, medium = raw
        fields = {"block_hashes": [external_hash(k, hashes) for k in keys], "medium": medium}
        tag = "BlockRemoved"
    else:
        fields, tag = {}, "AllBlocksCleared"
    if form == "array":
        return [tag, *fields.values()]
    return {"type": tag, **fields}


def encode_batch(events: Sequence[Any], rank: int, ts: float | None = None) -> list[Any]:
    """A batch of encoded events: ``[ts, events, data_parallel_rank]``, as vLLM's array-like ``KVEventBatch``."""
    return [time.time() if ts is None else ts, list(events), rank]


class IndexEvents:
    """Listens to a prefix index and hands what changed to a publisher, as raw events (cheap on the event loop).

    ``starts`` are the arenas' first block ids (a block's arena is the event's rank), ``media`` each arena's
    medium ("GPU", "CPU"). A host tier with an index of its own gives it an ``IndexEvents`` whose media say "CPU".
    """

    def __init__(
        self, put: Callable[[int, RawEvent], None], block_size: int, starts: Sequence[int], media: Sequence[str]
    ) -> None:
        self.put = put
        self.block_size = block_size
        self.starts = starts
        self.media = media

    def stored(self, nodes: Sequence[_Node]) -> None:
        first = nodes[0]
        rank = rank_of(self.starts, first.block)
        parent = first.parent.key if first.parent is not None else None
        step = 4 * self.block_size  # a salted chain's first block also stores its salt's tag: not tokens
        tokens = b"".join(n.tokens[-step:] for n in nodes)
        keys = [n.key for n in nodes]
        self.put(rank, ("stored", keys, parent, tokens, self.block_size, self.media[rank]))

    def removed(self, node: _Node) -> None:
        rank = rank_of(self.starts, node.block)
        self.put(rank, ("removed", [node.key], self.media[rank]))

    def cleared(self, rank: int = 0) -> None:
        self.put(rank, ("cleared",))
