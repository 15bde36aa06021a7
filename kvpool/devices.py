"""Block ids as one device's arena numbers them, for workers whose kernels index that arena alone.

The pool numbers blocks globally across its arenas (one per GPU) and fences each id with its block's generation; a
kernel indexes one arena's views. The conversion happens here, at the pool boundary, and nowhere in worker code.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

from kvpool.client import PoolClient
from kvpool.handoffs import Claim
from kvpool.ids import Fences
from kvpool.layout import KVLayout
from kvpool.protocol import CommitResponse, HandoffResponse, LookupResponse


class DeviceSession:
    """A session seen from one device's arena: block ids here are indices into that arena's views.

    The pool numbers blocks globally across its arenas, and fences each id with its block's generation; kernels
    index one arena. This view converts at the pool boundary (remembering the generations, :class:`Fences`), so
    worker code never mixes the two, and :meth:`claim` moves blocks parked on another device into this one (a
    prefill on GPU 0 handing over to a decode on GPU 1).
    """

    def __init__(self, pool: PoolClient, device: int | None = None, layout: KVLayout | None = None) -> None:
        self.pool = pool
        self.device = device
        self.arena = pool.arena(layout, device=device)
        self.first = self.arena.first_block
        self.fences = Fences(self.first, self.arena.num_blocks)

    def pool_ids(self, ids: Sequence[int]) -> list[int]:
        """This arena's indices as the pool's (fenced) ids, for a call made on the :class:`PoolClient` itself."""
        return self.fences.restore(ids)

    def _local(self, ids: Sequence[int]) -> list[int]:
        return self.fences.strip(ids)

    def alloc(self, num_blocks: int) -> list[int]:
        return self._local(self.pool.alloc(num_blocks, device=self.device))

    def free(self, block_ids: Sequence[int]) -> int:
        return self.pool.free(self.pool_ids(block_ids))

    def commit(self, block_ids: Sequence[int], token_ids: Sequence[int], salt: str | None = None) -> CommitResponse:
        return self.pool.commit(self.pool_ids(block_ids), token_ids, salt)

    def lookup(self, token_ids: Sequence[int], salt: str | None = None) -> LookupResponse:
        hit = self.pool.lookup(token_ids, device=self.device, salt=salt)
        return LookupResponse(block_ids=self._local(hit.block_ids), num_tokens=hit.num_tokens)

    def handoff(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        meta: dict[str, Any] | None = None,
        ttl_s: float | None = None,
        to: str | None = None,
    ) -> HandoffResponse:
        return self.pool.handoff(request_id, self.pool_ids(block_ids), num_tokens, meta, ttl_s, to)

    def confirm(self) -> None:
        self.pool.confirm()

    def claim(self, request_id: str | None = None, timeout_s: float = 30.0) -> Claim:
        got = self.pool.claim(request_id, timeout_s)
        ids = got.ids
        here = self.arena.descriptor.device_of(self.first)
        if ids and here is not None and self.arena.descriptor.device_of(ids[0]) != here:
            ids = array("q", self.pool.move(got.block_ids, device=here))
        local = self._local(ids)
        return Claim(got.request_id, got.num_tokens, got.meta, array("i", local), local, got.direct)
