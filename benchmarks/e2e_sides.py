"""The sides of an e2e comparison as processes: a pool with its workers, or monolithic workers, fed and timed.

The parent writes each request to a side at its arrival instant and reads each worker's JSON lines as they come;
every instant is taken here, on one clock.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kvpool.benchmarks import harness, machine, timings
from kvpool.benchmarks.e2e_workload import Request

Line = tuple[str, int, dict[str, Any] | None]


def _spawn(cmd: list[str], log: Path, lines: queue.Queue[Line], name: str, stdin: bool) -> subprocess.Popen[str]:
    with log.open("w") as err:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            bufsize=1,
            env=harness.child_env(),
            cwd=machine.ROOT,
        )

    def pump(stream: IO[str]) -> None:
        for line in stream:
            if line.strip():
                lines.put((name, time.perf_counter_ns(), json.loads(line)))
        lines.put((name, time.perf_counter_ns(), None))

    assert proc.stdout is not None
    threading.Thread(target=pump, args=(proc.stdout,), name=f"e2e-{name}", daemon=True).start()
    return proc


class Side:
    """Processes that take requests on the stdins of ``front`` (round-robin) and print first/final lines."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name = name
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.lines: queue.Queue[Line] = queue.Queue()
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.front: list[str] = []
        self.pools: list[harness.Server] = []
        self.block_nbytes = 0
        self._next_front = 0

    def spawn(self, name: str, cmd: list[str], front: bool) -> None:
        self.procs[name] = _spawn(cmd, self.workdir / f"{name}.log", self.lines, name, stdin=front)
        if front:
            self.front.append(name)

    def send(self, req: Request) -> None:
        name = self.front[self._next_front % len(self.front)]
        self._next_front += 1
        stdin = self.procs[name].stdin
        assert stdin is not None
        stdin.write(req.line() + "\n")
        stdin.flush()

    def event(self, name: str, record: dict[str, Any]) -> tuple[str, str] | None:
        """``("first" | "done", request_id)`` for a line, or None for lines that are neither."""
        if record.get("ready"):
            return None
        if record.get("error"):
            raise RuntimeError(f"{self.name}/{name} failed a request: {record}{self.logs()}")
        if name.startswith("prefill"):
            return "first", record["request_id"]
        if name.startswith("mono") and record.get("event") == "first":
            return "first", record["request_id"]
        return "done", record["request_id"]

    def prefix_bytes(self) -> int:
        """Bytes of the prefix blocks the side's pools have stored so far (committed as new: a prompt's blocks
        that an identical prefix committed before are not stored again); 0 for caches we cannot see."""
        from kvpool.client import http_client

        total = 0
        for pool in self.pools:
            with http_client(pool.url, None, 5.0) as http:
                stats = http.get("/stats").json()
            total += stats["counters"]["committed_blocks"] * self.block_nbytes
        return total

    def logs(self) -> str:
        out = []
        for log in sorted(self.workdir.glob("*.log")):
            out.append(f"\n--- {log.name} ---\n{log.read_text(errors='replace')[-3000:]}")
        return "".join(out)

    def stop(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(OSError):
                if proc.stdin:
                    proc.stdin.close()
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pool in self.pools:
            pool.stop()


@dataclass
class Env:
    """What every side is built from."""

    device: machine.Device
    workdir: Path
    layout: Any
    model_args: list[str]
    model_name: str
    threads: int
    cfg: dict[str, Any]

    def worker_flags(self) -> list[str]:
        return ["--threads", str(self.threads), *self.model_args] if self.threads else list(self.model_args)


def pool_side(
    env: Env, name: str, units: int, prefills_per_unit: int, devices: tuple[int, int] | None, push: bool = False,
    num_blocks: int | None = None, host_blocks: int = 0,
) -> Side:  # fmt: skip
    """``units`` pools, each with ``prefills_per_unit`` prefill workers and one decode worker."""
    side = Side(name, env.workdir)
    side.block_nbytes = env.layout.block_nbytes
    py = [sys.executable, "-m"]
    cfg = env.cfg
    arena = str(num_blocks or cfg["cache_blocks"])
    for u in range(units):
        flags = [*harness.layout_flags(env.layout), "--num-blocks", arena, "--model", env.model_name]
        if host_blocks:
            flags += ["--host-blocks", str(host_blocks)]
        if devices is not None:
            flags += ["--devices", f"{devices[0]},{devices[1]}"]
        pool = harness.start_pool(env.device, *flags)
        side.pools.append(pool)
        decode_name = f"{name}-decode-{u}"
        place_p = ["--device", str(devices[0])] if devices else []
        if devices and push:
            place_p += ["--push-to", str(devices[1])]
        place_d = ["--device", str(devices[1])] if devices else []
        base = ["--pool", pool.url, *env.worker_flags()]
        side.spawn(
            f"decode-{u}",
            [*py, "kvpool.workers.decode", *base, *place_d, "--name", decode_name, "--max-batch", str(cfg["max_batch"]),
             "--idle-wait-s", "0.02"],
            front=False,
        )  # fmt: skip
        for p in range(prefills_per_unit):
            side.spawn(
                f"prefill-{u}-{p}",
                [*py, "kvpool.workers.prefill", *base, *place_p, "--name", f"{name}-prefill-{u}-{p}", "--handoff-to",
                 decode_name, "--token-budget", str(cfg["token_budget"])],
                front=True,
            )  # fmt: skip
    return side


def mono_side(env: Env, name: str, devices: list[str]) -> Side:
    side = Side(name, env.workdir)
    cfg = env.cfg
    for i, dev in enumerate(devices):
        side.spawn(
            f"mono-{i}",
            [sys.executable, "-m", "kvpool.workers.monolithic", *env.worker_flags(), "--device", dev,
             "--num-blocks", str(cfg["cache_blocks"]), "--block-size", str(env.layout.block_size),
             "--kv-dtype", env.layout.dtype, "--max-batch", str(cfg["max_batch"]),
             "--token-budget", str(cfg["token_budget"])],
            front=True,
        )  # fmt: skip
    return side


def drive(side: Side, requests: list[Request], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Send each request at its instant, collect its first and final lines; per request: the instants (ns)."""
    got: dict[str, dict[str, Any]] = {r.request_id: {} for r in requests}
    pending = {r.request_id for r in requests}
    t0 = time.perf_counter_ns()
    deadline = time.monotonic() + max(r.at_s for r in requests) + timeout_s
    i = 0
    while pending:
        now = time.perf_counter_ns()
        while i < len(requests) and now >= t0 + int(requests[i].at_s * 1e9):
            got[requests[i].request_id]["sent"] = time.perf_counter_ns()
            side.send(requests[i])
            i += 1
        wait = (t0 + int(requests[i].at_s * 1e9) - now) / 1e9 if i < len(requests) else 0.05
        try:
            name, at, record = side.lines.get(timeout=max(0.0, min(wait, 0.05)))
        except queue.Empty:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{side.name}: {len(pending)} requests unanswered{side.logs()}") from None
            continue
        if record is None:
            raise RuntimeError(f"{side.name}: the {name} process exited{side.logs()}")
        ev = side.event(name, record)
        if ev is None or ev[1] not in got:
            continue
        kind, rid = ev
        got[rid][kind] = at
        if kind == "first":
            got[rid]["hit_tokens"] = record.get("hit_tokens", 0)
            if "total_ms" in record:
                got[rid]["worker_ms"] = (record["total_ms"], record["forward_ms"], record["batch"])
        else:
            got[rid]["tokens"] = record["tokens"]
            got[rid].setdefault("hit_tokens", record.get("hit_tokens", 0))
            pending.discard(rid)
    for r in got.values():
        r.setdefault("first", r["done"])
    return got


def summarize(
    requests: list[Request], got: dict[str, dict[str, Any]], slo_ttft_ms: float, slo_tpot_ms: float, window_s: float
) -> tuple[dict[str, Any], dict[str, list[int]]]:
    ttft, tpot, e2e, good, tokens, hits = [], [], [], 0, 0, 0
    for req in requests:
        g = got[req.request_id]
        t_first, t_done = g["first"] - g["sent"], g["done"] - g["sent"]
        n = len(g["tokens"])
        ttft.append(t_first)
        e2e.append(t_done)
        per_token = (t_done - t_first) // (n - 1) if n > 1 else 0
        if n > 1:
            tpot.append(per_token)
        good += t_first <= slo_ttft_ms * 1e6 and per_token <= slo_tpot_ms * 1e6
        tokens += n
        hits += g["hit_tokens"]
    span = max(got[r.request_id]["done"] for r in requests) - min(got[r.request_id]["sent"] for r in requests)
    arrivals = max(requests[-1].at_s, window_s)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    stats: dict[str, Any] = {
        "requests": len(requests),
        "offered_rps": len(requests) / arrivals,
        "goodput_rps": good / arrivals,
        "slo_met": good / len(requests),
        "output_tokens_per_s": tokens / span * 1e9,
        "hit_rate": hits / prompt_tokens,
        "prompt_tokens": prompt_tokens,
    }
    inside = [got[r.request_id]["worker_ms"] for r in requests if "worker_ms" in got[r.request_id]]
    if inside:
        # the prefill worker's own view: arrival to handoff, its last step's forward, requests in that step
        for i, key in enumerate(("prefill_total_ms", "prefill_step_ms", "prefill_batch")):
            stats[f"{key}_p50"] = timings.percentile(sorted(x[i] for x in inside), 50)
    for key, samples in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        stats |= {f"{key}_{k}": v for k, v in timings.summarize_ns(samples).items() if k != "n"}
    return stats, {"ttft_ns": timings.thin(ttft), "tpot_ns": timings.thin(tpot), "e2e_ns": timings.thin(e2e)}
