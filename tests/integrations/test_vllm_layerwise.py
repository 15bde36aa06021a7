"""Layer-by-layer loads on a side stream land the same bytes as a step's loads on the forward's stream."""

from __future__ import annotations

import pytest
import torch

from kvpool.integrations.vllm.kvviews import BlockCopier, kv_views
from kvpool.integrations.vllm.worker import WorkerSide
from kvpool.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=8, head_dim=64, block_size=16, dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layerwise_loads_equal_loads_before_the_forward() -> None:
    dev = torch.device("cuda")
    h, bs, d = LAYOUT.num_kv_heads, LAYOUT.block_size, LAYOUT.head_dim
    arena = [torch.randn(2, 64, bs, h, d, device=dev, dtype=torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    arena_views = [(a[0], a[1]) for a in arena]
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.num_layers)]
    src, dst = [5, 9, 1, 33, 60], [2, 7, 30, 11, 3]

    def engine() -> dict[str, torch.Tensor]:
        return {n: torch.zeros(40, h, bs, 2 * d, device=dev, dtype=torch.bfloat16) for n in names}

    plain, layered = engine(), engine()
    views = [kv_views(plain[n], LAYOUT, n) for n in names]
    BlockCopier(views, arena_views).load(src, dst)

    w = WorkerSide(None, LAYOUT, layerwise=True)  # type: ignore[arg-type]  # no pool call on this path
    w._engine = [kv_views(layered[n], LAYOUT, n) for n in names]
    w._layer_of = {n: i for i, n in enumerate(names)}
    w.copier = BlockCopier(w._engine, arena_views)
    w._load_layerwise(src, dst)
    for n in reversed(names):  # attention of each layer reads its cache after waiting for it
        w.wait_layer(n)
        layered[n].add_(0)
    w._join_loads()
    torch.cuda.synchronize()
    for n in names:
        assert torch.equal(plain[n], layered[n])
        assert plain[n].abs().sum() > 0
