"""The e2e workload: open-loop arrivals of a prompt mix, the same for both sides of a comparison."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

WORKLOADS = ("unique", "mixed")


@dataclass
class Request:
    at_s: float
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    kind: str

    def line(self) -> str:
        return json.dumps({"request_id": self.request_id, "prompt": self.prompt, "max_new_tokens": self.max_new_tokens})


def make_workload(workload: str, rate: float, cfg: dict[str, Any], vocab: int, seed: int) -> list[Request]:
    """Poisson arrivals over the duration (at least ``min_requests``), prompts and output lengths drawn.

    The arrival instants, output lengths and length jitters depend on ``seed`` and the rate only, so both
    workloads at one rate offer the same load; the tokens differ with the workload.
    """
    n_min, length, gen = cfg["min_requests"], cfg["prompt_len"], cfg["max_new_tokens"]
    timing = random.Random(f"{seed}-{rate}")
    rng = random.Random(f"{seed}-{rate}-{workload}")
    times, t = [], 0.0
    while t < cfg["duration_s"] or len(times) < n_min:
        times.append(t)
        t += timing.expovariate(rate)

    def toks(k: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(max(1, k))]

    jitters = [timing.uniform(0.75, 1.25) for _ in times]
    news = [max(1, int(gen * timing.uniform(0.5, 1.5))) for _ in times]

    mix = {k: float(v) for k, v in (part.split("=") for part in cfg["mix"].split(","))}
    classes, weights = list(mix), list(mix.values())
    systems = [toks(int(length * cfg["system_frac"])) for _ in range(cfg["num_systems"])]
    conversations: list[list[int]] = [[] for _ in range(max(1, cfg["num_systems"] * 2))]
    out = []
    for i, at in enumerate(times):
        kind = "unique" if workload == "unique" else rng.choices(classes, weights)[0]
        new, full = news[i], max(1, int(length * jitters[i]))
        if kind == "shared":
            system = rng.choice(systems)
            prompt = system + toks(full - len(system))
        elif kind == "multiturn":
            c = rng.randrange(len(conversations))
            history = conversations[c]
            if len(history) > 3 * length:
                history = []  # a conversation that outgrew its window starts over
            prompt = history + toks(length // 4 if history else full)
            conversations[c] = prompt + toks(new)  # the next turn carries this answer (as tokens of its own)
        else:
            prompt = toks(full)
        out.append(Request(at, f"{workload}-{rate:g}-{i}", prompt, new, kind))
    return out


def make_revisits(rate: float, cfg: dict[str, Any], vocab: int, seed: int) -> list[Request]:
    """Distinct prompts whose blocks take ``host_factor`` x the arena, each sent ``host_passes`` times.

    The first pass sends them in order, every later pass in a new shuffled order, at Poisson instants: a prompt
    comes back only after the others have pushed it out of an arena of ``host_arena_blocks``, so an LRU arena alone
    hits nearly nothing and a host tier that holds them all hits everything after the first pass.
    """
    length, arena = cfg["prompt_len"], cfg["host_arena_blocks"] * cfg["block_size"]
    rng = random.Random(f"{seed}-{rate}-revisit")
    count = max(2, math.ceil(cfg["host_factor"] * arena / length))
    prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]
    order = list(range(count))
    for _ in range(cfg["host_passes"] - 1):
        again = list(range(count))
        rng.shuffle(again)
        order += again
    out, t = [], 0.0
    for i, k in enumerate(order):
        out.append(Request(t, f"revisit-{rate:g}-{i}", prompts[k], 1, "first" if i < count else "revisit"))
        t += rng.expovariate(rate)
    return out
