"""A worker process for the integration tests: writes a known pattern into blocks, or reads and checks it.

Run as ``python -m tests.pattern_worker write|read|commit URL REQUEST_ID NUM_BLOCKS [NAME]``. The writer hands its
blocks off under REQUEST_ID and exits; the reader claims them in another process and checks every element. ``commit``
writes the pattern, commits the blocks as the prompt ``prompt_tokens(NUM_BLOCKS)`` and exits: its blocks stay
cached for any other process's lookup. With NAME, the writer addresses its handoff to the session of that name, and
the reader is that session, with an inbox: the ids then go from writer to reader directly.
"""

from __future__ import annotations

import sys
from array import array

import torch

from kvpool.client import PoolClient


def pattern(arena, block_ids: list[int]) -> list[torch.Tensor]:
    """A value per (layer, K/V, block, slot, head, dim) that no other position shares."""
    layout = arena.layout
    shape = (len(block_ids), layout.block_size, layout.num_kv_heads, layout.head_dim)
    out = []
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            base = torch.arange(shape[0] * shape[1] * shape[2] * shape[3], dtype=torch.float32).reshape(shape)
            ids = torch.tensor(block_ids, dtype=torch.float32).reshape(-1, 1, 1, 1)
            out.append(((base % 251) + ids * 3 + layer * 7 + kv * 11).to(arena.k(0).dtype))
    return out


def prompt_tokens(num_blocks: int, block_size: int) -> list[int]:
    return [(7 * i + 3) % 1000 for i in range(num_blocks * block_size)]


def main(argv: list[str]) -> int:
    mode, url, request_id, n = argv[0], argv[1], argv[2], int(argv[3])
    direct = argv[4] if len(argv) > 4 else None
    reader = mode == "read"
    name = direct if reader and direct else f"pattern-{mode}"
    role = "decode" if reader else "prefill"
    with PoolClient(url, name=name, role=role, inbox=reader and direct is not None, spin_s=30.0) as pool:
        arena = pool.arena()
        if mode in ("write", "commit"):
            ids = pool.alloc(n)
            idx = torch.tensor(ids, device=arena.device)
            for (layer, kv), values in zip(
                [(i, kv) for i in range(arena.layout.num_layers) for kv in (0, 1)], pattern(arena, ids), strict=True
            ):
                view = arena.k(layer) if kv == 0 else arena.v(layer)
                view[idx] = values.to(arena.device)
            if arena.device.type == "cuda":
                torch.cuda.synchronize()
            if mode == "commit":
                pool.commit(ids, prompt_tokens(n, arena.layout.block_size))
            else:
                packed = array("q", ids)  # as a worker holds the fenced ids it was given
                pool.handoff(request_id, packed, n * arena.layout.block_size, {"writer": "pattern"}, to=direct)
            print("WROTE", " ".join(map(str, ids)), flush=True)
        else:
            print("WAITING", flush=True)
            got = pool.claim(request_id, timeout_s=30)
            if got.meta != {"writer": "pattern"} or got.direct != (direct is not None):
                print("WRONG CLAIM", got, got.meta, flush=True)
                return 1
            idx = torch.tensor(got.block_ids, device=arena.device)
            for (layer, kv), want in zip(
                [(i, kv) for i in range(arena.layout.num_layers) for kv in (0, 1)],
                pattern(arena, got.block_ids),
                strict=True,
            ):
                view = arena.k(layer) if kv == 0 else arena.v(layer)
                if not torch.equal(view[idx].cpu(), want):
                    print("MISMATCH at layer", layer, "kv", kv, flush=True)
                    return 1
            pool.free(got.ids)
            print("READ OK", got.block_ids, "direct" if got.direct else "through the pool", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
