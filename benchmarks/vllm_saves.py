"""The vLLM connector's saver on one step's saves, alone and beside a thread that wants the GIL (CPU, no vLLM).

    python -m kvpool.benchmarks.vllm_saves [--prompts 32] [--rounds 12] [--park] [--json out.json]

A pool is started on a Unix socket (block size 16); each round commits, for every prompt, the first ``--held``
blocks of a fresh 1,024-token prompt (what another engine computed), then gives a ``Saver`` one step's saves: each
prompt's next ``--new`` blocks, taken from its reserve, past the held prefix. Timed from the saver's own
``saver_calls`` profile event: the wall time of the step's pool calls and the saver thread's CPU. With ``--park``
the saves are a prefill engine's, parked for a decode engine (which needs every id of each prompt).

In an engine core the saver shares the GIL with vLLM's scheduler and input thread. With ``--hog`` (the default runs
both) a thread computes in pure Python meanwhile: a thread that waits on a socket then waits for the GIL too, up to
a switch interval (5 ms) each time, so the figure counts the saver's waits as an engine would see them.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
from pathlib import Path
from typing import Any

from kvpool.client import PoolClient
from kvpool.integrations.vllm.link import PoolLink
from kvpool.integrations.vllm.plan import Save, prompt_digest
from kvpool.integrations.vllm.profile import Profile
from kvpool.integrations.vllm.saver import Job, Saver
from kvpool.server.launch import spawn

BS, PROMPT = 16, 1024


def hog(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(2000))


def one_step(url: str, probe: PoolClient, rng: random.Random, args: argparse.Namespace, work: Path, hogged: bool,
             i: int) -> tuple[float, float]:  # fmt: skip
    prompts = [[rng.randrange(128_000) for _ in range(PROMPT)] for _ in range(args.prompts)]
    for p in prompts if args.held else ():
        ids = probe.alloc(args.held)
        probe.commit(ids, p[: args.held * BS])
        probe.free(ids)
    pdir = work / f"profile-{i}"
    saver = Saver(PoolLink(url, f"saver-{i}"), BS, reserve=args.prompts * args.new, profile=Profile(str(pdir), "saver"))
    stop = threading.Event()
    other = threading.Thread(target=hog, args=(stop,), daemon=True)
    try:
        saver.flush()
        jobs = []
        for n, p in enumerate(prompts):
            new = saver.take(args.new)
            if new is None:
                raise RuntimeError("the saver's reserve is short")
            blocks = args.held + args.new
            tokens = p[: blocks * BS]
            park = f"saves-{i}:r{n}" if args.park else None
            digest = prompt_digest(tokens) if args.park else ""
            jobs.append(Job(Save(f"r{n}", tokens, list(range(blocks)), park, digest, skip=args.held), args.held, new))
        if hogged:
            other.start()
        saver.submit(None, jobs)
        saver.flush()
    finally:
        stop.set()
        if hogged:
            other.join()
        saver.close()
    saver.profile.maybe_write(force=True)
    events = [json.loads(line) for f in pdir.glob("timeline-*.jsonl") for line in f.read_text().splitlines()]
    calls = next(e for e in events if e["k"] == "saver_calls")
    if saver.stats["saved_blocks"] != args.prompts * args.new or saver.stats["parked"] != args.park * args.prompts:
        raise RuntimeError(f"saved {saver.stats['saved_blocks']} blocks and parked {saver.stats['parked']} prompts")
    if args.park:  # the decode engine's part: take the handoffs, and the blocks go back
        claims = probe.claim_many([f"saves-{i}:r{n}" for n in range(args.prompts)])
        probe.free([b for c in claims if c is not None for b in c.block_ids])
    return calls["ms"], calls["cpu_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32, help="saves in the step")
    ap.add_argument("--held", type=int, default=48, help="leading blocks of each prompt the pool holds")
    ap.add_argument("--new", type=int, default=16, help="blocks of each prompt the step saves")
    ap.add_argument("--rounds", type=int, default=12, help="steps timed per case (the first two are warm-up)")
    ap.add_argument("--hog", choices=["both", "on", "off"], default="both")
    ap.add_argument("--park", action="store_true", help="prefills parked for a decode engine")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    if args.held + args.new > PROMPT // BS:
        ap.error(f"--held + --new must be at most {PROMPT // BS} blocks")
    cases = {"both": [False, True], "on": [True], "off": [False]}[args.hog]
    work = Path(tempfile.mkdtemp(prefix="kvb-saves-"))
    sock = work / "pool.sock"
    blocks = 4 * args.prompts * (args.held + args.new) + 1024
    flags = ["kvpool", "serve", "--socket", str(sock), "--port", "0", "--num-blocks", str(blocks), "--num-layers", "2",
             "--num-kv-heads", "1", "--head-dim", "8", "--block-size", str(BS), "--log-level", "warning"]  # fmt: skip
    pool = spawn(flags, socket=sock, port=0, log=work / "pool.log", timeout_s=60)
    out: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "cases": {}}
    try:
        url, rng = f"unix://{sock}", random.Random(0)
        with PoolClient(url, name="probe") as probe:
            runs: dict[bool, list[tuple[float, float]]] = {h: [] for h in cases}
            for r in range(args.rounds):
                for h in cases:
                    runs[h].append(one_step(url, probe, rng, args, work, h, 2 * r + h))
        for h, got in runs.items():
            kept = got[2:] or got
            name = "beside a thread holding the GIL" if h else "alone"
            wall, cpu = statistics.median(w for w, _ in kept), statistics.median(c for _, c in kept)
            out["cases"][name] = {"wall_ms_p50": round(wall, 2), "cpu_ms_p50": round(cpu, 2), "n": len(kept)}
            what = f"{args.prompts} {'parked prefills' if args.park else 'saves'}"
            print(f"{what} ({args.held} blocks held, {args.new} new each), {name}: the step's pool calls "
                  f"{wall:.2f} ms wall, {cpu:.2f} ms CPU of the saver thread (p50 of {len(kept)})")  # fmt: skip
    finally:
        pool.stop()
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
