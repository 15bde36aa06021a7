"""Builders shared by the worker tests: paged caches with known contents, references, tiny HF checkpoints.

The transformers helpers import it lazily: callers skip first with ``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvpool.layout import KVLayout
from kvpool.workers.attention import gather_context, reference_attention
from kvpool.workers.kvcache import private_kv_caches


def paged_batch(
    lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    order: str = "layer_major",
    device: str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, K cache, V cache, block tables, context lens) for a decode batch.

    Blocks are taken in a shuffled order from an arena-shaped cache (layer 1 of 2, so the views have an offset
    and, block-major, a block stride); written slots hold N(0, 1) values, unwritten slots NaN, spare blocks too.
    """
    gen = torch.Generator().manual_seed(seed)
    layout = KVLayout(
        num_layers=2, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype, order=order
    )
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + 3
    k_cache, v_cache = private_kv_caches(layout, num_blocks, device, fill=float("nan"))[1]
    order_ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n, nb in zip(lens, per_seq, strict=True):
        table, order_ids = order_ids[:nb], order_ids[nb:]
        tables.append(table)
        blocks = torch.tensor(table, device=device)
        for cache in (k_cache, v_cache):
            values = torch.randn(nb * block_size, num_kv_heads, head_dim, generator=gen)
            values[n:] = float("nan")  # slots past the context stay unwritten
            cache[blocks] = values.view(nb, block_size, num_kv_heads, head_dim).to(device, cache.dtype)
    width = max(per_seq)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(device, k_cache.dtype)
    return q, k_cache, v_cache, padded, torch.tensor(lens, dtype=torch.int32, device=device)


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """fp64 attention of each sequence's one query over its contiguous, gathered context."""
    outs = []
    for i, n in enumerate(lens.tolist()):
        k = gather_context(k_cache, tables[i].long(), n)
        v = gather_context(v_cache, tables[i].long(), n)
        outs.append(reference_attention(q[i : i + 1], k, v, scale, torch.tensor([n - 1]))[0])
    return torch.stack(outs)


def tiny_hf_checkpoint(path: Path, seed: int = 0, **overrides: object) -> Path:
    """A random ``LlamaForCausalLM`` saved as safetensors; weights spread enough to give clear argmaxes."""
    import transformers

    torch.manual_seed(seed)
    fields: dict[str, object] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_theta=5000.0, initializer_range=0.1,
    )  # fmt: skip
    config = transformers.LlamaConfig(**(fields | overrides))
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu") -> list[list[int]]:
    """transformers' own greedy ``generate``, one prompt at a time (no padding to get in the way)."""
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    out = []
    for p in prompts:
        ids = hf.generate(
            torch.tensor([p], device=device), do_sample=False, max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        out.append(ids[0, len(p) :].tolist())
    return out
