"""The paged Llama model on the CPU: config reading, checkpoints, and invariance to how the cache is paged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvpool.workers.checkpoint import load_safetensors
from kvpool.workers.kvcache import check_layout, layout_for, private_kv_caches
from kvpool.workers.model import LlamaConfig, LlamaModel
from kvpool.workers.monolithic import greedy_generate

SMALL = LlamaConfig(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip


def test_config_reads_both_transformers_formats() -> None:
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu"}
    v4 = LlamaConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": None, "eos_token_id": 7})
    v5 = LlamaConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
                                "eos_token_id": [7, 8], "dtype": "bfloat16"})  # fmt: skip
    assert v4.rope_theta == v5.rope_theta == 5e5 and v4.rope_scaling is None and v5.rope_scaling is None
    assert v4.head_dim == 16 and v4.eos_token_id == [7] and v5.eos_token_id == [7, 8]
    assert v5.torch_dtype == "bfloat16"
    scaled = LlamaConfig.from_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert scaled.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    with pytest.raises(ValueError, match="gelu"):
        LlamaConfig.from_dict({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        LlamaModel.random(LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_layout_check_names_the_difference() -> None:
    check_layout(SMALL, layout_for(SMALL, 16, "float32"))
    wrong = layout_for(LlamaConfig(num_hidden_layers=3, num_key_value_heads=2), 16, "float32")
    with pytest.raises(ValueError, match="num_layers: model 2 != arena 3"):
        check_layout(SMALL, wrong)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        check_layout(SMALL, layout_for(SMALL, 16, "float8_e4m3fn"))


@pytest.mark.slow
def test_sharded_checkpoint_round_trip(tmp_path: Path) -> None:
    model = LlamaModel.random(SMALL, seed=3)
    tensors = {  # rebuild the unfused tensors the way a checkpoint stores them
        "model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm, "lm_head.weight": model.lm_head,
    }  # fmt: skip
    d, kv = SMALL.head_dim, SMALL.num_key_value_heads * SMALL.head_dim
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.qkv.split([SMALL.num_attention_heads * d, kv, kv])
        gate, up = layer.gate_up.chunk(2)
        tensors |= {
            p + "input_layernorm.weight": layer.input_norm, p + "post_attention_layernorm.weight": layer.post_norm,
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
            p + "self_attn.o_proj.weight": layer.o, p + "mlp.gate_proj.weight": gate,
            p + "mlp.up_proj.weight": up, p + "mlp.down_proj.weight": layer.down,
        }  # fmt: skip
    names = sorted(tensors)
    shards = {f"model-0000{j + 1}-of-00002.safetensors": names[j::2] for j in range(2)}
    for file, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, tmp_path / file)
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({**SMALL.to_dict(), "model_type": "llama"}))
    assert set(load_safetensors(tmp_path)) == set(tensors)
    loaded = LlamaModel.from_pretrained(tmp_path)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9] * 20]
    layout = layout_for(SMALL, 4, "float32")
    assert greedy_generate(loaded, prompts, 6, layout) == greedy_generate(model, prompts, 6, layout)


@pytest.mark.slow
def test_greedy_tokens_do_not_depend_on_paging() -> None:
    """Block size and arena order change only where K/V live, never the tokens."""
    model = LlamaModel.random(SMALL, seed=1)
    prompts = [list(range(3, 40)), [5], list(range(100, 117))]
    runs = [
        greedy_generate(model, prompts, 10, layout_for(SMALL, bs, "float32", order), max_batch=mb)
        for bs, order, mb in [(16, "layer_major", 8), (1, "block_major", 8), (7, "block_major", 1)]
    ]
    assert runs[0] == runs[1] == runs[2]
    assert all(len(r) == 10 for r in runs[0])


@pytest.mark.slow
def test_prefill_with_cached_prefix_equals_full_prefill() -> None:
    model = LlamaModel.random(SMALL, seed=2)
    layout = layout_for(SMALL, 8, "float32", "block_major")
    tokens = torch.randint(0, SMALL.vocab_size, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    full_caches = private_kv_caches(layout, 6, fill=float("nan"))
    full = model.prefill(tokens, [0, 1, 2, 3, 4, 5], 0, full_caches)
    split_caches = private_kv_caches(layout, 12, fill=float("nan"))
    table = [11, 3, 7, 0, 5, 9]
    model.prefill(tokens[:24], table[:3], 0, split_caches)  # what an earlier request left in the pool
    cached = model.prefill(tokens, table, 24, split_caches)
    assert (full - cached).abs().max().item() < 1e-4
    # the same K, in other blocks: bit for bit in layer 0, up to rounding after a layer of attention
    assert torch.equal(full_caches[0][0][:3], split_caches[0][0][table[:3]])
    torch.testing.assert_close(full_caches[1][0][:3], split_caches[1][0][table[:3]])


def test_random_weights_are_seeded() -> None:
    a, b, c = (LlamaModel.random(SMALL, seed=s) for s in (5, 5, 6))
    assert torch.equal(a.layers[1].qkv, b.layers[1].qkv) and not torch.equal(a.layers[1].qkv, c.layers[1].qkv)
