"""kvpool bench SUITE [options] (or python -m kvpool.benchmarks SUITE [options]): run one benchmark suite.

Each suite measures kvpool side by side with what users would do instead, in the same run, prints a result block
and writes JSON and a PNG into --out.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

from kvpool.benchmarks import harness
from kvpool.commands import Parser

SUITES: dict[str, tuple[str, str]] = {
    "control-plane": ("kvpool.benchmarks.control_plane", "/alloc+/free latency and throughput against its floor"),
    "flood": ("kvpool.benchmarks.flood", "token holders' latency while the pool is flooded without the token"),
    "handoff": ("kvpool.benchmarks.handoff", "prefill -> decode KV handoff against torch.multiprocessing and copies"),
    "attach": ("kvpool.benchmarks.attach", "a new process opening arenas of growing size"),
    "e2e": ("kvpool.benchmarks.e2e", "prefill and decode workers through the pool against one monolithic worker"),
    "prefix": ("kvpool.benchmarks.prefix", "lookup and commit of a 32k-token prompt, in process and via the pool"),
    "copy": ("kvpool.benchmarks.copy", "KV moved between two GPUs' arenas by block ids against a plain peer copy"),
    "host-tier": ("kvpool.benchmarks.hosttier", "the host tier's offloads and restores against a plain pinned copy"),
    "slab": ("kvpool.benchmarks.slab", "slab alloc/free and slab-to-slab handoffs against the datagram floor"),
    "decode": ("kvpool.benchmarks.decode", "the workers' decode step against its memory-bandwidth floor"),
    "remote": ("kvpool.benchmarks.remote", "a handoff read from a peer pool (--peers) against a raw NIXL READ"),
    "vllm": ("kvpool.benchmarks.vllm", "vLLM engines with the kvpool connector against vLLM alone (GPU, vLLM)"),
}
# Suites owned elsewhere that bring their own ``main(argv)``; offered only when their module exists.
DELEGATED: dict[str, tuple[str, str]] = {"soak": ("kvpool.benchmarks.soak", "long-running load on a pool")}


def available() -> dict[str, tuple[str, str]]:
    delegated = {k: v for k, v in DELEGATED.items() if importlib.util.find_spec(v[0]) is not None}
    return {**SUITES, **delegated}


def suite_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one suite: the common options, then the suite's own (imported only when asked for)."""
    module = importlib.import_module(SUITES[name][0])
    parser = Parser(
        prog=f"kvpool bench {name}", description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    harness.add_common_arguments(parser)
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)
    return parser


def usage() -> str:
    lines = [
        "usage: kvpool bench SUITE [options]      (or: python -m kvpool.benchmarks SUITE [options])",
        "       kvpool bench SUITE --help         the suite's options and what it measures",
        "",
        "Each suite measures kvpool side by side with what users would do instead, in the same run, prints a",
        "result block and writes JSON and a PNG into --out (results/ by default).",
        "",
        "suites:",
    ]
    lines += [f"  {name:<15}{help_text}" for name, (_, help_text) in available().items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    suites = available()
    if not argv or argv[0] in {"-h", "--help"}:
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in suites:
        known = ", ".join(suites)
        print(f"kvpool bench: no suite {name!r}: one of {known}\nkvpool bench --help says what each measures",
              file=sys.stderr)  # fmt: skip
        return 2
    if name in DELEGATED:
        return int(importlib.import_module(DELEGATED[name][0]).main(rest) or 0)
    args = suite_parser(name).parse_args(rest)
    harness.ARGV[:] = argv
    return int(args.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
