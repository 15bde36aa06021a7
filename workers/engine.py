"""The decode engine: one greedy step for a batch whose members change between steps, on CUDA one graph replay.

Why graphs: at batch 32 the GPU work of a 1B model's step is a few milliseconds of memory reads, while issuing
its ~180 kernels from Python takes longer than that. So the step is captured once per batch-size bucket
(:data:`BUCKETS`) and replayed; a batch is padded up to its bucket with rows that read and write nothing.

A captured graph reads fixed addresses, so the step's inputs live in static device buffers that are refilled in
place: a small ``[5, max_batch]`` int32 block (token ids, positions, context lengths, each token's cache slot as
block and offset) and the block tables ``[max_batch, width]``. Both are staged in pinned host memory and sent
with one copy each; the tables only when a row changed. Each row remembers which sequence's block list it holds
and how much of it was sent, so a sequence that crosses into a new block costs one new entry, not a new table.
The split count of the paged kernel is fixed per bucket: the kernel cuts each sequence's context itself, so one
graph serves any mix of lengths up to ``width`` blocks (a longer sequence widens the tables and the graphs are
captured again).

The host waits once per step, for the sampled tokens. Without CUDA (or Triton) the same bookkeeping feeds the
eager forward pass, unpadded, so the CPU tests exercise it too.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from kvpool.workers.model import KVCaches, LlamaModel, fused_decode_available
from kvpool.workers.sequence import Sequence, blocks_needed

#: batch sizes a graph is captured for (and ``max_batch``); a batch runs in the smallest that holds it
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

_IDS, _POS, _LENS, _SLOT_BLOCK, _SLOT_OFFSET = range(5)


class DecodeEngine:
    """Greedy decode steps of ``model`` over ``kv_caches`` for up to ``max_batch`` sequences at a time.

    ``max_context`` sizes the block tables (default: the model's ``max_position_embeddings``, at most what the
    cache holds); longer sequences still work, at the cost of one re-capture. ``use_graphs`` defaults to
    whether the fused CUDA path is available.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: KVCaches,
        block_size: int,
        max_batch: int = 32,
        max_context: int | None = None,
        use_graphs: bool | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_batch = max_batch
        self.device = model.device
        self.fused = fused_decode_available(self.device)
        self.use_graphs = self.fused if use_graphs is None else use_graphs and self.fused
        # one shape for every step when the model must not depend on its batch (workers.invariance)
        self.buckets = [max_batch] if model.batch_invariant else [b for b in BUCKETS if b < max_batch] + [max_batch]
        cache_tokens = kv_caches[0][0].shape[0] * block_size
        context = min(max_context or model.config.max_position_embeddings, cache_tokens)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_pool: object | None = None
        pinned = self.device.type == "cuda"
        self.host_meta = torch.zeros((5, max_batch), dtype=torch.int32, pin_memory=pinned)
        self.meta = torch.zeros((5, max_batch), dtype=torch.int32, device=self.device)
        self.tokens = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        self._alloc_tables(blocks_needed(max(context, 1), block_size))

    def _alloc_tables(self, width: int) -> None:
        pinned = self.device.type == "cuda"
        self.width = width
        self.host_tables = torch.zeros((self.max_batch, width), dtype=torch.int32, pin_memory=pinned)
        self.tables = torch.zeros((self.max_batch, width), dtype=torch.int32, device=self.device)
        self._rows: list[list[int] | None] = [None] * self.max_batch  # the block list each row holds
        self._sent = [0] * self.max_batch  # how many of its entries are in host_tables
        self.graphs.clear()

    @torch.inference_mode()
    def capture(self) -> int:
        """Capture every bucket's graph now (largest first, so the smaller ones reuse its memory), so that no
        request pays for a capture later; the number of graphs, 0 where graphs are off."""
        if self.use_graphs:
            for b in sorted(self.buckets, reverse=True):
                self._graph(b)
        return len(self.graphs)

    def bucket(self, n: int) -> int:
        """The padded batch size a step of ``n`` sequences runs at."""
        if not self.use_graphs:
            return n
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def step(self, seqs: Seq[Sequence]) -> list[int]:
        """The greedy next token of each sequence; its K/V at ``num_cached`` are written on the way.

        Every sequence must already own the block its next token goes in (:func:`workers.sequence.grow`).
        """
        n = len(seqs)
        if n == 0:
            return []
        if n > self.max_batch:
            raise ValueError(f"{n} sequences in one step, more than the engine's max_batch of {self.max_batch}")
        need = max(len(s.block_ids) for s in seqs)
        if need > self.width:
            self._alloc_tables(max(need, 2 * self.width))
        b = self.bucket(n)
        graph = self._graph(b) if self.use_graphs else None
        changed = self._stage(seqs, b)
        if self.device.type != "cuda":
            return self._eager_cpu(n)
        self.meta.copy_(self.host_meta, non_blocking=True)
        if changed:
            self.tables[:n].copy_(self.host_tables[:n], non_blocking=True)
        if graph is not None:
            graph.replay()
        else:
            self.tokens[:b].copy_(self._forward(b))
        return self.tokens[:n].tolist()

    def _stage(self, seqs: Seq[Sequence], b: int) -> bool:
        """Fill the host buffers for this step; whether any table row changed."""
        meta = self.host_meta.numpy()
        tables = self.host_tables.numpy()
        changed = False
        positions = []
        for i, s in enumerate(seqs):
            ids = s.block_ids
            if self._rows[i] is not ids or self._sent[i] > len(ids):
                self._rows[i], self._sent[i] = ids, 0
            sent = self._sent[i]
            if sent < len(ids):
                tables[i, sent : len(ids)] = ids[sent:]
                self._sent[i] = len(ids)
                changed = True
            positions.append(s.num_cached)
            if s.num_cached >= len(ids) * self.block_size:
                raise ValueError(
                    f"sequence {s.request_id!r} has no block for position {s.num_cached}: grow it before the step"
                )
        n = len(seqs)
        pos = np.asarray(positions, dtype=np.int64)
        meta[_IDS, :n] = [s.output[-1] for s in seqs]
        meta[_POS, :n] = pos
        meta[_LENS, :n] = pos + 1
        meta[_SLOT_BLOCK, :n] = tables[np.arange(n), pos // self.block_size]
        meta[_SLOT_OFFSET, :n] = pos % self.block_size
        self._pad(n, b)
        return changed

    def _pad(self, start: int, end: int) -> None:
        meta = self.host_meta.numpy()
        meta[:, start:end] = 0
        meta[_SLOT_BLOCK, start:end] = -1

    def _forward(self, b: int) -> torch.Tensor:
        m = self.meta
        hidden = self.model.decode_hidden(
            m[_IDS, :b], m[_POS, :b], self.kv_caches, m[_SLOT_BLOCK, :b], m[_SLOT_OFFSET, :b], self.tables[:b],
            m[_LENS, :b], num_splits=self._splits(b),
        )  # fmt: skip
        return self.model.logits(hidden).argmax(-1)

    def _splits(self, b: int) -> int:
        from kvpool.workers.triton_paged import choose_splits, default_block_n

        c = self.model.config
        block_n = default_block_n(c.head_dim)
        if self.model.batch_invariant:  # a sequence's split points must not depend on the table's width either
            return choose_splits(b, c.num_key_value_heads, c.max_position_embeddings, block_n, self.device)
        return choose_splits(b, c.num_key_value_heads, self.width * self.block_size, block_n, self.device)

    def _graph(self, b: int) -> torch.cuda.CUDAGraph:
        """The graph of bucket ``b``, captured on first use over padding rows, so capturing writes nothing."""
        graph = self.graphs.get(b)
        if graph is not None:
            return graph
        self._pad(0, b)
        self.meta.copy_(self.host_meta)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(b)  # compiles the kernels and settles cuBLAS's choices outside the capture
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self.tokens[:b].copy_(self._forward(b))
        self.graphs[b] = graph
        return graph

    def _eager_cpu(self, n: int) -> list[int]:
        m = self.host_meta
        width = max(self._sent[:n])
        hidden = self.model.decode_hidden(
            m[_IDS, :n], m[_POS, :n], self.kv_caches, m[_SLOT_BLOCK, :n], m[_SLOT_OFFSET, :n],
            self.host_tables[:n, :width], m[_LENS, :n],
        )  # fmt: skip
        return self.model.logits(hidden).argmax(-1).tolist()
