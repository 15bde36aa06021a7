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

import pytest

from .compose import DOCKER, GPU_FILES, ROOT, model, tool

DOCKERFILE = DOCKER / "Dockerfile"
INSTALL = DOCKER / "install.sh"
IGNORE = DOCKER / "Dockerfile.dockerignore"


def instructions(dockerfile: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
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


def args_of(name: str, dockerfile: Path = DOCKERFILE) -> list[str]:
    return [rest for word, rest in instructions(dockerfile) if word == name]


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
    assert words[script - 1] == "bash", installs[0]
    assert not {"--torch", "--cpu"} & set(words[script:]), "torch comes from the base image"
    for run in runs:
        assert not re.search(r"\b(pip|uv|conda)\b", run), f"install through docker/install.sh, not: {run}"


def arg_defaults(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    return dict(arg.partition("=")[::2] for arg in args_of("ARG", dockerfile))


def test_runs_as_a_non_root_user() -> None:
    users = args_of("USER")
    assert users, "no USER: the image would run as root"
    user, _, group = users[-1].partition(":")
    # numeric, so that the host and Kubernetes' runAsNonRoot can tell it is not root (hadolint DL3066)
    uid = re.sub(r"\$\{(\w+)\}", lambda m: arg_defaults()[m.group(1)], user)
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert group == user, "the user's own group, which owns the socket directory"
    created = [run for run in args_of("RUN") if re.search(rf"useradd\b.*--uid \"?{re.escape(user)}\"?", run)]
    assert created, f"no user with uid {user} is created"


def test_ci_installs_with_the_same_script() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^[^#]*\bbash docker/install\.sh --cpu ", ci, re.MULTILINE), (
        ".ci/run must install with docker/install.sh, as the image does"
    )


def test_entrypoint_is_kvpool() -> None:
    (entrypoint,) = args_of("ENTRYPOINT")
    assert json.loads(entrypoint) == ["kvpool"]
    (cmd,) = args_of("CMD")
    assert json.loads(cmd) == model(GPU_FILES)["services"]["kvpool"]["command"]


def test_socket_directory_belongs_to_the_user() -> None:
    # a fresh named volume takes the owner of the image's directory it is mounted on
    (created,) = [run for run in args_of("RUN") if "useradd" in run]
    user = re.search(r"useradd\b.* (\w+)\s*($|&&)", created).group(1)
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


@pytest.mark.slow
def test_hadolint_clean() -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("no hadolint here (the test extra installs it on Linux x86-64)")
    done = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "", done.stdout + done.stderr


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
if [[ "$1" == "-c" && "$2" == *urlopen* ]]; then
  echo "probe $3" >>"$state/log"; [[ -z "${FAKE_INDEX_DOWN:-}" ]]; exit
fi
if [[ "$1 $2 $3" == "-m pip install" ]]; then
  shift 3
  echo "pip install $*" >>"$state/log"
  for a in "$@"; do
    if [[ "$prev" == "--constraint" ]]; then echo "constraint $(cat "$a")" >>"$state/log"; fi
    if [[ "$a" == torch==* ]]; then
      [[ -n "${FAKE_NO_TORCH:-}" ]] && exit 1
      v=${a#torch==}; echo "${v%+cpu}+cpu" >"$state/torch"
    fi
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


def test_cpu_takes_torch_from_the_cpu_index(tmp_path: Path) -> None:
    code, err, log = run_install(tmp_path, "--cpu", "-e", ".[test]")
    assert code == 0, err
    index = "https://download.pytorch.org/whl/cpu"
    assert log[:2] == [f"probe {index}", f"pip install --no-cache-dir --index-url {index} torch==2.13.0"]
    assert log[2].endswith(" -e .[test]") and log[3] == "constraint torch==2.13.0+cpu"


def test_cpu_index_and_version_can_be_changed(tmp_path: Path) -> None:
    mirror = "https://mirror.example/whl/cpu"
    code, err, log = run_install(tmp_path, "--cpu", KVPOOL_TORCH_INDEX=mirror, KVPOOL_TORCH_VERSION="2.12.1")
    assert code == 0, err
    assert log[1] == f"pip install --no-cache-dir --index-url {mirror} torch==2.12.1"


def test_cpu_without_the_index_asks_for_the_cpu_build_only(tmp_path: Path) -> None:
    code, err, log = run_install(tmp_path, "--cpu", FAKE_INDEX_DOWN="1")
    assert code == 0, err
    # a "+cpu" local version: the configured sources can only satisfy it with a CPU build, never a CUDA one
    assert log[1] == "pip install --no-cache-dir torch==2.13.0+cpu"


def test_cpu_says_what_to_do_when_no_cpu_build_is_found(tmp_path: Path) -> None:
    code, err, _ = run_install(tmp_path, "--cpu", FAKE_INDEX_DOWN="1", FAKE_NO_TORCH="1")
    assert code == 1 and "set KVPOOL_TORCH_INDEX" in err
