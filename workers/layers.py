"""The per-layer maths of a Llama decoder in plain torch, as ``transformers`` does it: RMSNorm in fp32, the
rotate-half form of rotary embeddings, and the weights one decoder layer holds."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the statistics in fp32 and the product in the weight's dtype, as transformers does."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class LayerWeights:
    """One decoder layer; q/k/v and gate/up are fused so each is one matmul."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
