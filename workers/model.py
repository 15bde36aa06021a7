"""A Llama-architecture decoder in plain torch whose attention reads and writes a paged KV cache.

Why not ``transformers``: the workers must put each token's K and V into arena blocks chosen by the pool and read
them back through a block table, which no stock cache class does; and the workers must run where only torch and
safetensors are installed. The maths follows ``transformers``' ``LlamaForCausalLM`` step for step (RMSNorm in
fp32, rotate-half RoPE with ``rope_theta`` and the ``linear``/``llama3`` scalings, grouped-query attention,
SwiGLU), so greedy tokens match it in fp32; ``tests/workers`` checks that.

Weights come from a local Hugging Face-format directory (``config.json`` and ``*.safetensors``, sharded or not),
or are drawn from a seeded generator. Nothing is downloaded.

The cache is passed in as ``kv_caches``: per layer a ``(K, V)`` pair shaped ``[num_blocks, block_size,
num_kv_heads, head_dim]``, the arena's own views or a private cache with the same geometry
(:func:`workers.kvcache.private_kv_caches`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from kvpool.workers.attention import (
    packed_prefill_attention,
    paged_decode_attention,
    prefill_attention,
    triton_available,
    write_kv,
)
from kvpool.workers.attention_batch import AttentionBatch, PrefillPiece
from kvpool.workers.layers import LayerWeights, rms_norm, rotate_half
from kvpool.workers.llama_config import LlamaConfig, rope_inv_freq

KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]]


class LlamaModel:
    """Weights plus a forward pass over a paged cache. Not an ``nn.Module``: inference only, no autograd."""

    def __init__(
        self, config: LlamaConfig, tensors: dict[str, torch.Tensor], device: str | torch.device, dtype: torch.dtype
    ) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in tensors else None

        def fused(*names: str) -> torch.Tensor | None:
            parts = [maybe(n) for n in names]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise ValueError(f"checkpoint has only some of {names}")
            return torch.cat(parts, 0)  # type: ignore[arg-type]

        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        lm_head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = self.embed if lm_head == "model.embed_tokens.weight" else take(lm_head)
        self.layers: list[LayerWeights] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(
                LayerWeights(
                    input_norm=take(p + "input_layernorm.weight"),
                    qkv=fused(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),  # type: ignore[arg-type]
                    qkv_bias=fused(a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"),
                    o=take(a + "o_proj.weight"),
                    o_bias=maybe(a + "o_proj.bias"),
                    post_norm=take(p + "post_attention_layernorm.weight"),
                    gate_up=fused(m + "gate_proj.weight", m + "up_proj.weight"),  # type: ignore[arg-type]
                    gate_up_bias=fused(m + "gate_proj.bias", m + "up_proj.bias"),
                    down=take(m + "down_proj.weight"),
                    down_bias=maybe(m + "down_proj.bias"),
                )
            )
        self.inv_freq = rope_inv_freq(config).to(self.device)
        self.scale = config.head_dim**-0.5
        #: fixed-shape forwards on the fused path (:mod:`workers.invariance`); set by ``--batch-invariant``
        self.batch_invariant = False

    # construction ----------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> LlamaModel:
        """Load a local Hugging Face-format checkpoint; ``dtype`` defaults to the checkpoint's."""
        from kvpool.workers.checkpoint import load_safetensors

        config = LlamaConfig.from_dir(path)
        dtype = dtype or getattr(torch, config.torch_dtype, torch.float32)
        return cls(config, load_safetensors(path), device, dtype)

    @classmethod
    def random(
        cls,
        config: LlamaConfig,
        seed: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> LlamaModel:
        """Seeded random weights, the same on every device (drawn on the CPU in fp32, then moved).

        Projections are drawn with std ``fan_in ** -0.5`` (not transformers' 0.02) so that logits are spread
        out: greedy tokens then do not hinge on rounding, and runs that differ only in kernels agree.
        """
        gen = torch.Generator().manual_seed(seed)

        def normal(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

        c = config
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        t: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": torch.randn(c.vocab_size, c.hidden_size, generator=gen),
            "model.norm.weight": torch.ones(c.hidden_size),
        }
        if not c.tie_word_embeddings:
            t["lm_head.weight"] = normal(c.vocab_size, c.hidden_size)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            t[p + "input_layernorm.weight"] = torch.ones(c.hidden_size)
            t[p + "post_attention_layernorm.weight"] = torch.ones(c.hidden_size)
            t[p + "self_attn.q_proj.weight"] = normal(hq * d, c.hidden_size)
            t[p + "self_attn.k_proj.weight"] = normal(hkv * d, c.hidden_size)
            t[p + "self_attn.v_proj.weight"] = normal(hkv * d, c.hidden_size)
            t[p + "self_attn.o_proj.weight"] = normal(c.hidden_size, hq * d)
            t[p + "mlp.gate_proj.weight"] = normal(c.intermediate_size, c.hidden_size)
            t[p + "mlp.up_proj.weight"] = normal(c.intermediate_size, c.hidden_size)
            t[p + "mlp.down_proj.weight"] = normal(c.hidden_size, c.intermediate_size)
        return cls(config, t, device, dtype)

    # forward ---------------------------------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype)[:, None, :], emb.sin().to(self.dtype)[:, None, :]

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        if batch.q_lens is not None:
            assert batch.block_tables is not None
            return packed_prefill_attention(
                q, k_cache, v_cache, batch.block_tables, batch.q_lens, batch.cached_lens, self.scale,
                device_args=batch.packed_args,
            )  # fmt: skip
        if batch.block_tables is not None:
            assert batch.context_lens is not None
            return paged_decode_attention(
                q, k_cache, v_cache, batch.block_tables, batch.context_lens, self.scale,
                max_context_len=batch.max_context_len,
            )  # fmt: skip
        assert batch.block_table is not None
        return prefill_attention(q, k_cache, v_cache, batch.block_table, batch.num_cached, self.scale)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, batch: AttentionBatch
    ) -> torch.Tensor:
        """Final hidden states ``[N, hidden]`` of ``N`` tokens; writes their K/V into ``kv_caches``."""
        c = self.config
        n = input_ids.shape[0]
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos, sin = self._rope(positions)
        h = self.embed[input_ids]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
            q, k, v = F.linear(x, layer.qkv, layer.qkv_bias).split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(n, hq, d), k.view(n, hkv, d), v.view(n, hkv, d)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            write_kv(k_cache, v_cache, k, v, batch.slot_blocks, batch.slot_offsets)
            o = self._attend(q, k_cache, v_cache, batch)
            h = h + F.linear(o.reshape(n, hq * d), layer.o, layer.o_bias)
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down, layer.down_bias)
        return rms_norm(h, self.norm, c.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the given hidden states (only those that are sampled from, to spare the vocab matmul)."""
        return F.linear(hidden, self.lm_head).float()

    def prefill(
        self, token_ids: Sequence[int], block_table: Sequence[int], num_cached: int, kv_caches: KVCaches
    ) -> torch.Tensor:
        """Run the tokens after the first ``num_cached`` (whose K/V are already in ``block_table``'s blocks).

        Returns the fp32 logits ``[vocab]`` of the last token. ``block_table`` must cover ``len(token_ids)``.
        """
        return self.prefill_batch([PrefillPiece(block_table, num_cached, token_ids[num_cached:])], kv_caches)[0]

    def prefill_batch(self, pieces: Sequence[PrefillPiece], kv_caches: KVCaches) -> torch.Tensor:
        """One forward over several sequences' new tokens, packed: ``[len(pieces), vocab]`` fp32 logits, each
        of a piece's last token (a chunk that does not end its prompt has no use for them).

        Batching is what makes a prefill worker fast: the projections and MLP of every piece run as one matmul,
        and the attention as one kernel launch per layer, instead of one small forward per request.
        """
        if not pieces:
            raise ValueError("prefill_batch needs at least one piece")
        bs = kv_caches[0][0].shape[1]
        for p in pieces:
            if not p.tokens:
                raise ValueError("prefill needs at least one token to compute")
            if len(p.block_table) * bs < p.start + len(p.tokens):
                raise ValueError(f"{len(p.block_table)} blocks of {bs} cannot hold {p.start + len(p.tokens)} tokens")
        if self.batch_invariant and fused_decode_available(self.device):
            from kvpool.workers.invariance import invariant_prefill

            return invariant_prefill(
                pieces, bs, self.device, lambda i, p, b: self._prefill_fused(i, p, kv_caches, b), self.logits
            )
        batch = AttentionBatch.packed(pieces, bs, self.device)
        ids = torch.tensor([t for p in pieces for t in p.tokens], dtype=torch.long).to(self.device)
        positions = torch.cat([torch.arange(p.start, p.start + len(p.tokens)) for p in pieces]).to(self.device)
        if batch.packed_args is not None and fused_decode_available(self.device):
            hidden = self._prefill_fused(ids, positions, kv_caches, batch)
        else:
            hidden = self.forward(ids, positions, kv_caches, batch)
        last = torch.tensor(batch.q_lens).cumsum(0).sub(1).to(self.device)
        return self.logits(hidden[last])

    def decode(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        kv_caches: KVCaches,
    ) -> torch.Tensor:
        """One step for a batch: token ``i`` sits at ``positions[i]`` of sequence ``i``. Returns [B, vocab] fp32."""
        bs = kv_caches[0][0].shape[1]
        batch = AttentionBatch.decode(block_tables, positions, bs, self.device)
        assert batch.block_tables is not None and batch.context_lens is not None
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.decode_hidden(
            ids, pos, kv_caches, batch.slot_blocks, batch.slot_offsets, batch.block_tables, batch.context_lens,
            max_context_len=batch.max_context_len,
        )  # fmt: skip
        return self.logits(hidden)

    def decode_hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        num_splits: int | None = None,
        max_context_len: int | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[B, hidden]`` of one token per sequence; every argument lives on the device.

        On CUDA (with Triton) the step is the fused kernels of :mod:`workers.triton_ops` around the matmuls and
        the paged kernel: no host sync when ``num_splits`` is given, so :mod:`workers.engine` captures it in a
        CUDA graph. There a row whose ``slot_blocks`` entry is negative and whose context length is 0 pads the
        batch: it writes nothing and reads nothing. Elsewhere it is :meth:`forward`, unpadded.
        """
        if fused_decode_available(self.device):
            return self._decode_fused(
                input_ids, positions, kv_caches, slot_blocks, slot_offsets, block_tables, context_lens,
                num_splits, max_context_len,
            )  # fmt: skip
        batch = AttentionBatch(
            slot_blocks=slot_blocks.long(),
            slot_offsets=slot_offsets.long(),
            block_tables=block_tables,
            context_lens=context_lens,
            max_context_len=max_context_len or int(context_lens.max()),
        )
        return self.forward(input_ids.long(), positions.long(), kv_caches, batch)

    @torch.inference_mode()
    def _decode_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: KVCaches,
        slot_blocks: torch.Tensor,
        slot_offsets: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        num_splits: int | None,
        max_context_len: int | None,
    ) -> torch.Tensor:
        from kvpool.workers.triton_ops import add_rms_norm, rope_store_kv, silu_mul
        from kvpool.workers.triton_paged import paged_decode_attention_triton

        c = self.config
        n = input_ids.shape[0]
        hq, hkv, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        h = F.embedding(input_ids, self.embed)
        delta: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = add_rms_norm(delta, h, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q = rope_store_kv(qkv, positions, self.inv_freq, k_cache, v_cache, slot_blocks, slot_offsets, hq, hkv)
            o = paged_decode_attention_triton(
                q, k_cache, v_cache, block_tables, context_lens, self.scale,
                max_context_len=max_context_len, num_splits=num_splits,
            )  # fmt: skip
            delta = F.linear(o.view(n, hq * d), layer.o, layer.o_bias)
            x = add_rms_norm(delta, h, layer.post_norm, eps)
            delta = F.linear(silu_mul(F.linear(x, layer.gate_up, layer.gate_up_bias)), layer.down, layer.down_bias)
        return add_rms_norm(delta, h, self.norm, eps)

    @torch.inference_mode()
    def _prefill_fused(
        self, ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCaches, batch: AttentionBatch
    ) -> torch.Tensor:
        """:meth:`forward` for a packed prefill with the decode step's fused kernels around the matmuls: about
        eight launches a layer instead of forty, which is most of a prefill's time when few tokens are new."""
        from kvpool.workers.triton_ops import add_rms_norm, rope_store_kv, silu_mul
        from kvpool.workers.triton_prefill import packed_prefill_attention_triton

        c = self.config
        n = ids.shape[0]
        hq, hkv, d, eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        cu, cached, tiles = batch.packed_args
        assert batch.block_tables is not None
        h = F.embedding(ids, self.embed)
        delta: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x = add_rms_norm(delta, h, layer.input_norm, eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q = rope_store_kv(qkv, positions, self.inv_freq, k_cache, v_cache, batch.slot_blocks, batch.slot_offsets,
                              hq, hkv)  # fmt: skip
            o = packed_prefill_attention_triton(q, k_cache, v_cache, batch.block_tables, cu, cached, tiles, self.scale)
            delta = F.linear(o.view(n, hq * d), layer.o, layer.o_bias)
            x = add_rms_norm(delta, h, layer.post_norm, eps)
            delta = F.linear(silu_mul(F.linear(x, layer.gate_up, layer.gate_up_bias)), layer.down, layer.down_bias)
        return add_rms_norm(delta, h, self.norm, eps)


def fused_decode_available(device: torch.device) -> bool:
    """Whether the decode step can run the Triton kernels: a CUDA device and an importable ``triton``."""

    return triton_available(device)
