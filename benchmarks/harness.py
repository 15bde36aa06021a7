"""What every suite shares: options, device choice, real servers in subprocesses, statistics, the printed
result block, and the JSON and PNG written for each run.

Each suite is one module with ``add_arguments(parser)`` and ``run(args) -> int``; this module keeps them short
and alike, so that a reader compares figures, not formats. Nothing here imports torch at module level: the
control-plane client processes never need it, and starting them stays cheap.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import shlex
import socket
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.benchmarks.machine import (
    Device,
    describe_device,
    device_info,
    git_revision,
    versions,
)
from kvpool.server import launch

RESULT_WIDTH = 64

# -- options ------------------------------------------------------------------------------------------------


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every suite takes, with the same names and meanings."""
    add_output_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few rounds: a smoke run, not a figure")
    parser.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto", help="arena backend [auto: cuda when present]"
    )
    parser.add_argument("--gpu", type=int, default=0, metavar="INDEX", help="CUDA ordinal of the arena [0]")
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (each variant once per round)")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the results go and how the run shows itself: the options the soak shares with the suites."""
    parser.add_argument("--out", type=Path, default=Path("results"), help="where the JSON and PNG go [results/]")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, CI)")
    parser.add_argument("--seed", type=int, default=0, help="seed of token ids and orders")
    parser.add_argument("--tag", default="", help="added to the result file names")
    parser.add_argument(
        "--metadata", action="append", default=[], metavar="KEY=VALUE", help="stored in the JSON (repeatable)"
    )


def parse_size(text: str) -> int:
    """Bytes from ``1MiB``, ``8GiB``, ``4096`` (the pool's own parser, so flags read alike everywhere)."""
    from kvpool.server.config import parse_size as parse

    try:
        return parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_list(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if float(n).is_integer() else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_rate(per_s: float) -> str:
    """A rate with three significant figures and a k or M suffix: 1.76M, 412k, 950."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if per_s >= scale:
            value = per_s / scale
            return f"{value:.3g}{suffix}" if value < 100 else f"{value:.0f}{suffix}"
    return f"{per_s:.3g}" if per_s < 100 else f"{per_s:.0f}"


def fmt_us(us: float) -> str:
    """Microseconds in the unit a reader takes in at a glance."""
    if us >= 1e6:
        return f"{us / 1e6:.2f} s"
    if us >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} us"


# -- progress and the printed block ----------------------------------------------------------------------------


class PlainProgress:
    """Progress as a line on stderr every tenth of the way, where tqdm (the bench extra) is not installed."""

    def __init__(self, total: int, desc: str, disable: bool) -> None:
        self.total, self.desc, self.disable = max(total, 1), desc, disable
        self.n, self.shown, self.postfix = 0, -1, ""

    def update(self, n: int = 1) -> None:
        self.n += n
        tenth = self.n * 10 // self.total
        if not self.disable and tenth != self.shown:
            self.shown = tenth
            postfix = f" {self.postfix}" if self.postfix else ""
            print(f"{self.desc}: {self.n}/{self.total}{postfix}", file=sys.stderr, flush=True)

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def progress(total: int, desc: str, disable: bool) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:
        return PlainProgress(total, desc, disable)
    return tqdm(total=total, desc=desc, disable=disable, dynamic_ncols=True, file=sys.stderr, leave=False)


def typed_command() -> str:
    """The command line as the user typed it: ``kvpool bench ...`` or ``python -m <module> ...``."""
    if Path(sys.argv[0]).name == "kvpool":
        return shlex.join(["kvpool", *sys.argv[1:]])
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None:
        return shlex.join([Path(sys.executable).name, "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])
    return shlex.join(["kvpool", "bench", *ARGV])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass
class Target:
    """A goal of the project, checked against this run's own figures (ratios measured side by side)."""

    name: str
    goal: str
    measured: str
    met: bool | None
    detail: str = ""

    def line(self) -> str:
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[self.met]
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.name}: {self.measured} [goal {self.goal}] {verdict}{detail}"


# -- the run's record -----------------------------------------------------------------------------------------


@dataclass
class Report:
    """One suite run: its configuration, where it ran, its figures; printed once and saved as JSON and PNG."""

    suite: str
    args: argparse.Namespace
    device: Device
    config: dict[str, Any]
    results: list[dict[str, Any]] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    started: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))

    def to_json(self) -> dict[str, Any]:
        meta = dict(item.split("=", 1) if "=" in item else (item, "") for item in self.args.metadata)
        return {
            "suite": self.suite,
            "timestamp": self.started.isoformat(timespec="seconds"),
            "command": typed_command(),
            "config": self.config,
            "device": device_info(self.device),
            "versions": versions(),
            "git": git_revision(),
            "metadata": meta,
            "results": self.results,
            "targets": [t.__dict__ for t in self.targets],
            "notes": self.notes,
            "raw": self.raw,
        }

    def print_block(self, title: str, body: str) -> None:
        info = device_info(self.device)
        head = f" kvpool {title} Result "
        print("=" * ((RESULT_WIDTH - len(head)) // 2) + head + "=" * ((RESULT_WIDTH - len(head) + 1) // 2))
        print(f"{'Device:':<12}{describe_device(info)}")
        print(f"{'Date:':<12}{self.started.strftime('%Y-%m-%d %H:%M UTC')}")
        print(body)
        if self.targets:
            print("Targets:")
            for target in self.targets:
                print(f"  {target.line()}")
        for note in self.notes:
            print(f"Note: {note}")
        print("=" * RESULT_WIDTH)

    def save(self, plot: Any) -> tuple[Path, Path | None]:
        """Write ``<suite>[-tag]-<UTC time>.json`` and, from ``plot()``'s figure, ``.png`` into ``--out``.

        Without matplotlib (the bench extra) there is no PNG; the JSON holds every figure all the same.
        """
        out: Path = self.args.out
        out.mkdir(parents=True, exist_ok=True)
        stem = "-".join(filter(None, [self.suite, self.args.tag, self.started.strftime("%Y%m%dT%H%M%SZ")]))
        json_path, png_path = out / f"{stem}.json", out / f"{stem}.png"
        json_path.write_text(json.dumps(self.to_json(), indent=1, default=str) + "\n")
        try:
            figure = plot() if callable(plot) else plot
        except ImportError:
            print(f"Saved {json_path} (no PNG: matplotlib is not installed; pip install 'kvpool[bench]')")
            return json_path, None
        if figure is None:  # a run whose figures a table says best
            print(f"Saved {json_path}")
            return json_path, None
        figure.savefig(png_path, dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(figure)
        print(f"Saved {json_path} and {png_path}")
        return json_path, png_path


ARGV: list[str] = []  # set by __main__ so the JSON records the exact command line


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: no display, same PNG everywhere."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def bandwidth_plot(report: Report, variants: Sequence[str], title: str, suite: str) -> Any:
    """GB/s p50 against the bytes moved, one line per variant (rows with ``variant``, ``bytes``, ``gb_per_s_p50``)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for v in variants:
        rows = [r for r in report.results if r["variant"] == v]
        ax.plot([r["bytes"] / 2**20 for r in rows], [r["gb_per_s_p50"] for r in rows], marker="o", label=v)
    ax.set(xscale="log", title=title, xlabel="KV (MiB)", ylabel="GB/s")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.suptitle(f"kvpool {suite} ({describe_device(device_info(report.device))})")
    return fig


# -- servers in subprocesses ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: this checkout first on the path, what was there kept after it."""
    return launch.child_env(**(extra or {}))


Server = launch.ServerProcess


def start_server(name: str, argv: Sequence[str], timeout_s: float = 300.0) -> Server:
    """Start ``python -m <argv> --socket S --port P`` and wait for ``/health`` to answer 200.

    The timeout is long because a large CPU arena is reserved page by page before the pool reports healthy.
    """
    workdir = Path(tempfile.mkdtemp(prefix="kvb-"))
    sock, port, log = workdir / "s.sock", free_port(), workdir / f"{name}.log"
    return launch.spawn(
        [*argv, "--socket", str(sock), "--port", str(port)],
        socket=sock, port=port, log=log, env=child_env(), timeout_s=timeout_s, workdir=workdir,
    )  # fmt: skip


def start_pool(device: Device, *flags: str, timeout_s: float = 300.0) -> Server:
    """A real ``kvpool serve`` on the run's device; sessions live an hour so that idle benchmark clients keep theirs."""
    argv = ["kvpool", "serve", "--backend", device.backend, "--device", str(device.index)]
    argv += ["--log-level", "warning", "--lease-ttl-s", "3600", "--handoff-ttl-s", "3600", *flags]
    return start_server("pool", argv, timeout_s)


@contextlib.contextmanager
def servers(*starters: Any) -> Iterator[list[Server]]:
    """Start servers one after another and stop all of them on the way out, whatever happened."""
    started: list[Server] = []
    try:
        for start in starters:
            started.append(start())
        yield started
    finally:
        for server in reversed(started):
            server.stop()


def layout_flags(layout: Any) -> list[str]:
    """``kvpool serve`` flags for a :class:`kvpool.layout.KVLayout`."""
    return [
        "--num-layers",
        str(layout.num_layers),
        "--num-kv-heads",
        str(layout.num_kv_heads),
        "--head-dim",
        str(layout.head_dim),
        "--block-size",
        str(layout.block_size),
        "--dtype",
        layout.dtype,
        "--order",
        layout.order,
    ]


def wait_children(procs: Iterable[Any], timeout_s: float = 30.0) -> None:
    """Join worker processes, killing any that hang, so that a failed run never leaves one behind."""
    for proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            proc.kill()
            proc.join()
