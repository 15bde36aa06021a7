"""The shape of a Llama-architecture model: the fields of a Hugging Face ``LlamaConfig`` the forward pass uses,
and the rotary frequencies they imply."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch


@dataclass
class LlamaConfig:
    """The fields of a Hugging Face ``LlamaConfig`` that the forward pass uses."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 0  # 0: hidden_size // num_attention_heads, as in transformers
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Read a ``config.json`` of either transformers 4 (``rope_theta``) or 5 (``rope_parameters``)."""
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported: Llama uses 'silu'")
        if raw.get("pretraining_tp", 1) != 1:
            raise ValueError("pretraining_tp > 1 checkpoints are not supported")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        if "rope_theta" in rope:
            values["rope_theta"] = rope.pop("rope_theta")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        values["rope_scaling"] = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        eos = raw.get("eos_token_id")
        values["eos_token_id"] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        values["torch_dtype"] = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
        return cls(**values)

    @classmethod
    def from_dir(cls, path: str | Path) -> LlamaConfig:
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Inverse frequencies of rotate-half RoPE, fp32, with the ``linear`` and ``llama3`` scalings."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear and llama3 are)")
