"""docker/Dockerfile and docker/install.sh: the image installs kvpool with the script CI runs, keeps the base
image's torch, and runs as a non-root user."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

from .compose import DOCKER, GPU_FILES, ROOT, model

DOCKERFILE = DOCKER / "Dockerfile"
INSTALL = DOCKER / "install.sh"
IGNORE = DOCKER / "Dockerfile.dockerignore"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def args_of(name: str) -> list[str]:
    return [rest for word, rest in instructions() if word == name]


def test_base_is_a_pinned_cuda_pytorch_runtime() -> None:
    (first_from,) = args_of("FROM")
    base = first_from
    for arg in args_of("ARG"):
        key, _, default = arg.partition("=")
        base = base.replace(f"${{{key}}}", default).replace(f"${key}", default)
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime(@sha256:[0-9a-f]{64})?", base)


def test_installs_only_through_the_ci_script() -> None:
    runs = args_of("RUN")
    installs = [run for run in runs if "docker/install.sh" in run]
    assert len(installs) == 1, "the image must install kvpool with docker/install.sh, as CI does"
    words = shlex.split(installs[0])
    script = next(i for i, word in enumerate(words) if word.endswith("docker/install.sh"))
    assert words[script - 1] == "bash" and "--torch" not in words[script:], "torch comes from the base image"
    for run in runs:
        assert not re.search(r"\b(pip|uv|conda)\b", run), f"install through docker/install.sh, not: {run}"


def test_runs_as_a_non_root_user() -> None:
    users = args_of("USER")
    assert users, "no USER: the image would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}
    created = [run for run in args_of("RUN") if re.search(rf"useradd\b.*\b{re.escape(user)}\s*($|&&)", run)]
    assert created, f"user {user} is never created"
    for arg in args_of("ARG"):
        key, _, default = arg.partition("=")
        assert not (key.endswith("UID") and default.strip() == "0"), arg


def test_ci_installs_with_the_same_script() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^[^#]*\bbash docker/install\.sh --torch torch==\S+ ", ci, re.MULTILINE), (
        ".ci/run must install with docker/install.sh, as the image does"
    )


def test_entrypoint_is_kvpool() -> None:
    (entrypoint,) = args_of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["kvpool"]
    (cmd,) = args_of("CMD")
    assert json.loads(cmd) == model(GPU_FILES)["services"]["kvpool"]["command"]


def test_socket_directory_belongs_to_the_user() -> None:
    # a fresh named volume takes the owner of the image's directory it is mounted on
    user = args_of("USER")[-1].split(":")[0]
    assert any(re.search(rf"install -d -o {user} -g {user} .*/run/kvpool\b", run) for run in args_of("RUN"))
    env = " ".join(args_of("ENV"))
    assert "KVPOOL_SOCKET=/run/kvpool/kvpool.sock" in env
    assert "KVPOOL_URL=unix:///run/kvpool/kvpool.sock" in env


def test_compose_builds_this_dockerfile_from_the_repo_root() -> None:
    build = model(GPU_FILES)["services"]["kvpool"]["build"]
    assert (DOCKER / build["context"]).resolve() == ROOT
    assert (ROOT / build["dockerfile"]).resolve() == DOCKERFILE


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parents decides."""
    ignored = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        body = pattern.lstrip("!").strip("/")
        regex = "".join(
            ".*" if part == "**" else "[^/]*" if part == "*" else "[^/]" if part == "?" else re.escape(part)
            for part in re.split(r"(\*\*|\*|\?)", body)
        )
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not keep
    return ignored


def test_build_context_has_what_the_install_needs() -> None:
    patterns = [p.strip() for p in IGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", "docker/install.sh", project["project"]["readme"]]
    needed += [f"{folder}/__init__.py" for folder in project["tool"]["setuptools"]["package-dir"].values()]
    for path in needed:
        assert not _ignored(path, patterns), f"{path} is left out of the build context"
    for path in (
        ".git/HEAD",
        ".venv/bin/python",
        "tests/__init__.py",
        "kvpool/__pycache__/x.pyc",
        "results/x",
    ):
        assert _ignored(path, patterns), f"{path} should stay out of the build context"


def test_install_script_parses() -> None:
    subprocess.run(["bash", "-n", str(INSTALL)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(INSTALL)], check=True)


# A stand-in python: knows torch's version from a file, and logs pip's arguments and constraints.
FAKE_PYTHON = r"""#!/usr/bin/env bash
state=$(dirname "$0")
if [[ "$1" == "-c" && "$2" == *'version("torch")'* ]]; then
  [[ -s "$state/torch" ]] || { echo "PackageNotFoundError: torch" >&2; exit 1; }
  cat "$state/torch"; exit 0
fi
if [[ "$1" == "-c" && "$2" == *sysconfig* ]]; then echo "$state/bin"; exit 0; fi
if [[ "$1 $2 $3" == "-m pip install" ]]; then
  shift 3
  echo "pip install $*" >>"$state/log"
  for a in "$@"; do
    if [[ "$prev" == "--constraint" ]]; then echo "constraint $(cat "$a")" >>"$state/log"; fi
    if [[ "$a" == torch==* ]]; then echo "${a#torch==}+cpu" >"$state/torch"; fi
    prev=$a
  done
  if [[ -n "${FAKE_PIP_REPLACES_TORCH:-}" && "$*" != *torch==* ]]; then echo 9.9.9 >"$state/torch"; fi
  exit 0
fi
echo "unexpected: $*" >&2; exit 2
"""


def run_install(tmp_path: Path, *args: str, torch: str = "", **env: str) -> tuple[int, str, list[str]]:
    tmp_path.mkdir(exist_ok=True)
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (tmp_path / "torch").write_text(torch)
    (tmp_path / "bin").mkdir()
    kvpool = tmp_path / "bin" / "kvpool"
    kvpool.write_text('#!/bin/sh\necho "kvpool $*" >>"$(dirname "$0")/../log"\n')
    kvpool.chmod(0o755)
    done = subprocess.run(
        ["bash", str(INSTALL), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHON": str(python), **env},
    )
    log = (tmp_path / "log").read_text().splitlines() if (tmp_path / "log").exists() else []
    return done.returncode, done.stderr, log


def test_install_keeps_the_base_torch(tmp_path: Path) -> None:
    code, err, log = run_install(tmp_path, "/src", torch="2.9.1+cu128")
    assert code == 0, err
    assert log[0].startswith("pip install --no-cache-dir --constraint ") and log[0].endswith(" /src")
    assert log[1:] == ["constraint torch==2.9.1+cu128", "kvpool --help"]


def test_install_puts_the_given_torch_in_first(tmp_path: Path) -> None:
    code, err, log = run_install(tmp_path, "--torch", "torch==2.13.0", ".[test]")
    assert code == 0, err
    assert log[0] == "pip install --no-cache-dir torch==2.13.0"
    assert log[1].endswith(" .[test]") and log[2] == "constraint torch==2.13.0+cpu"


def test_install_refuses_without_torch(tmp_path: Path) -> None:
    code, err, log = run_install(tmp_path, ".")
    assert code != 0 and "no torch" in err and log == []


def test_install_passes_pip_arguments_on(tmp_path: Path) -> None:
    code, err, log = run_install(tmp_path, "-e", ".[test]", torch="2.13.0+cpu")
    assert code == 0, err
    assert log[0].endswith(" -e .[test]")
    code, err, log = run_install(tmp_path / "default", torch="2.13.0+cpu")
    assert code == 0, err
    assert log[0].endswith(" .")


def test_install_fails_if_torch_was_replaced(tmp_path: Path) -> None:
    code, err, _ = run_install(tmp_path, ".", torch="2.9.1+cu128", FAKE_PIP_REPLACES_TORCH="1")
    assert code != 0 and "torch changed from 2.9.1+cu128 to 9.9.9" in err
