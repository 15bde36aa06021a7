"""Second process of the CUDA aliasing test: maps the arena, then obeys commands read from stdin."""

from __future__ import annotations

import sys
import time

import torch

from kvpool.client import PoolClient


def main() -> int:
    url = sys.argv[1]
    with PoolClient(url, name="alias-peer") as pool:
        t0 = time.perf_counter()
        arena = pool.arena()
        arena.raw[0].item()
        print(f"OPENED {(time.perf_counter() - t0) * 1e3:.3f} ms", flush=True)
        for line in sys.stdin:
            cmd, layer, block, value = line.split()
            view = arena.k(int(layer))[int(block)]
            if cmd == "write":
                view.fill_(float(value))
                torch.cuda.synchronize()
                print("DONE", flush=True)
            else:
                print("VALUE", float(view.float().mean()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
