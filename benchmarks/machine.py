"""What ran a benchmark: the device it measured (GPU or CPU), the revision, and the versions of what matters.

Recorded in every result's JSON, so that a figure always says where, when and with what it was measured.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# -- device ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    """Where the arena lives: ``cuda`` (with its ordinal) or ``cpu``."""

    kind: str
    index: int = 0

    @property
    def backend(self) -> str:
        return self.kind

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index}" if self.kind == "cuda" else "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"


def resolve_device(args: argparse.Namespace) -> Device:
    """The device of this run: CUDA when present unless ``--device cpu``; a missing GPU asked for is an error."""
    if args.device == "cpu":
        return Device("cpu")
    import torch

    if torch.cuda.is_available():
        if args.gpu >= torch.cuda.device_count():
            raise SystemExit(f"--gpu {args.gpu}: only {torch.cuda.device_count()} CUDA devices are visible")
        return Device("cuda", args.gpu)
    if args.device == "cuda":
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu)")
    return Device("cpu")


def device_info(device: Device) -> dict[str, Any]:
    """What the figures were measured on: the GPU's name and memory, or the CPU's model and cores."""
    info: dict[str, Any] = {"kind": device.kind, "cpu": cpu_model(), "cpu_count": os.cpu_count()}
    if device.is_cuda:
        import torch

        props = torch.cuda.get_device_properties(device.index)
        info.update(
            index=device.index,
            name=props.name,
            total_memory_bytes=props.total_memory,
            capability=f"{props.major}.{props.minor}",
            cuda=torch.version.cuda,
        )
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={device.index}"],
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            )
            if out.returncode == 0:
                info["driver"] = out.stdout.strip()
    else:
        info["name"] = info["cpu"]
    return info


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def describe_device(info: dict[str, Any]) -> str:
    if info["kind"] == "cuda":
        return f"{info['name']} (cuda:{info['index']}), {info['cpu_count']} CPU cores"
    return f"CPU: {info['cpu']}, {info['cpu_count']} cores"


def git_revision() -> dict[str, Any]:
    """The commit the figures belong to, and whether the tree had changes on top of it.

    ``KVPOOL_GIT_REVISION`` wins when set: a copy of the tree run elsewhere (a container, another machine) may carry
    no repository, or a stale one, and only the one who copied it knows what it holds.
    """
    given = os.environ.get("KVPOOL_GIT_REVISION")
    if given:
        return {"revision": given, "dirty": None}
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return {"revision": "unknown", "dirty": None}
    if rev.returncode != 0:
        return {"revision": "unknown", "dirty": None}
    return {"revision": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def versions() -> dict[str, str]:
    import importlib.metadata as md

    import kvpool

    out = {"python": platform.python_version(), "kvpool": kvpool.__version__}
    for name in ("torch", "fastapi", "uvicorn", "pydantic", "httpx"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "absent"
    return out
