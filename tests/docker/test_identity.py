"""Who each container runs as, who owns the pool's socket, and whom each client trusts: they must line up.

The pool creates its sockets (mode 0660) as its own user in /run/kvpool, a named volume that a fresh start seeds
from the image's directory. A client refuses a socket that is not of its own uid, root's, or ``KVPOOL_POOL_UID``
(kvpool/trust.py), so a vLLM engine left as root in vLLM's image refuses the pool's socket. These tests read the
uid each service runs as from compose (``user:``) and its image's Dockerfile, and ask kvpool's own trust rule.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvpool import trust

from .compose import CPU_FILES, DOCKER, GPU_FILES, LEGACY_FILES, ROOT, model
from .test_compose import ENV_EXAMPLE, POOL, SOCKET_DIR, _compose_cli, env_of, mounts, resolved_env
from .test_image import arg_defaults, args_of

TOKEN = "a-token-set-in-docker-env"
PROFILES = {"workers": (), "vllm": ("vllm",), "vllm-gpus": ("vllm-gpus",)}
CASES = [
    pytest.param(files, profiles, id=f"{'+'.join(f.removesuffix('.yaml') for f in files)}-{name}")
    for files in (GPU_FILES, CPU_FILES, LEGACY_FILES)
    for name, profiles in PROFILES.items()
]


def dockerfile(service: dict[str, Any]) -> Path:
    return (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).resolve()


def _resolve(text: str, path: Path) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: arg_defaults(path)[m[1] or m[2]], text)


def image_user(path: Path) -> str:
    """The image's last USER, its ARGs resolved; root where there is none (vLLM's and PyTorch's images)."""
    users = args_of("USER", path)
    return _resolve(users[-1], path) if users else "0:0"


def created_users(path: Path) -> dict[str, int]:
    """name -> uid of each user a RUN creates with useradd --uid."""
    out = {}
    for run in args_of("RUN", path):
        for m in re.finditer(r'useradd\b[^&;]*?--uid "?([^"\s]+)"?[^&;]* (\w+)\s*(?:$|&&|;)', run):
            out[m[2]] = int(_resolve(m[1], path))
    return out


def socket_dir(path: Path) -> tuple[int, str] | None:
    """(owner uid, mode) of the image's /run/kvpool as a RUN creates it with install -d; None if no RUN does."""
    for run in args_of("RUN", path):
        m = re.search(rf"install -d -o (\w+) -g \w+ -m (\d+) {SOCKET_DIR}\b", run)
        if m:
            return created_users(path)[m[1]], m[2]
    return None


def runs_as(service: dict[str, Any]) -> tuple[int, int]:
    """compose's ``user:``, else its image's USER."""
    stated = service.get("user") or image_user(dockerfile(service))
    user, _, group = str(stated).partition(":")
    assert user.isdigit() and group.isdigit(), f"user {stated!r}: numeric uid:gid, so it needs no passwd entry"
    return int(user), int(group)


def uids_trusted(uid: int, env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """kvpool's own rule, for a process of ``uid`` with the container's environment."""
    monkeypatch.setattr(os, "getuid", lambda: uid)
    monkeypatch.delenv(trust.POOL_UID_ENV, raising=False)
    if env.get(trust.POOL_UID_ENV) is not None:
        monkeypatch.setenv(trust.POOL_UID_ENV, str(env[trust.POOL_UID_ENV]))
    return trust.trusted_uids()


@pytest.mark.parametrize(("files", "profiles"), CASES)
def test_every_container_states_who_it_runs_as_and_its_image_agrees(
    files: tuple[str, ...], profiles: tuple[str, ...]
) -> None:
    for name, service in model(files, profiles=profiles)["services"].items():
        assert "user" in service, f"{name}: no user: it would run as whatever its image says (vLLM's: root)"
        uid, gid = runs_as(service)
        assert uid != 0, f"{name} runs as root"
        assert image_user(dockerfile(service)) == f"{uid}:{gid}", f"{name}: its image runs as another user"


@pytest.mark.parametrize(("files", "profiles"), CASES)
def test_every_client_trusts_the_pools_socket_and_may_open_it(
    files: tuple[str, ...], profiles: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    services = model(files, profiles=profiles)["services"]
    pool_uid, pool_gid = runs_as(services[POOL])  # the sockets' owner: the pool's process creates them
    for name, service in services.items():
        if name == POOL:
            continue
        uid, gid = runs_as(service)
        trusted = uids_trusted(uid, env_of(service), monkeypatch)
        assert pool_uid in trusted, f"{name} (uid {uid}) refuses the pool's socket of uid {pool_uid}: UntrustedSocket"
        assert pool_uid == uid or pool_gid == gid, f"{name}: the sockets are mode 0660, neither owner nor group"


@pytest.mark.parametrize(("files", "profiles"), CASES)
def test_every_client_gets_the_pools_token(files: tuple[str, ...], profiles: tuple[str, ...]) -> None:
    """A pool with KVPOOL_TOKEN answers 401 on its Unix socket too; a service's own environment map replaces the
    pool's whole one (YAML merge keys are shallow), so the vLLM engines once lost the token."""
    dotenv = {"KVPOOL_TOKEN": TOKEN}
    for name, service in model(files, dotenv, profiles=profiles)["services"].items():
        got = resolved_env(service, dotenv).get("KVPOOL_TOKEN")
        assert got == TOKEN, f"{name} does not get KVPOOL_TOKEN from docker/.env: the pool would answer it 401"


@pytest.mark.parametrize(("files", "profiles"), CASES)
def test_the_socket_volume_starts_as_the_pools(files: tuple[str, ...], profiles: tuple[str, ...]) -> None:
    services = model(files, profiles=profiles)["services"]
    pool_uid, _ = runs_as(services[POOL])
    for name, service in services.items():
        assert SOCKET_DIR in mounts(service), name
        # whichever container mounts the fresh volume first seeds its owner and mode from its image
        made = socket_dir(dockerfile(service))
        assert made is not None, f"{name}: its image has no {SOCKET_DIR}; a fresh volume would be root's"
        owner, mode = made
        assert owner == pool_uid, f"{name}: its image's {SOCKET_DIR} is uid {owner}'s, not the pool's"
        assert int(mode, 8) & 0o022 == 0, f"{name}: {SOCKET_DIR} mode {mode}: the client refuses a writable dir"


def test_the_rule_these_tests_ask_is_the_clients() -> None:
    assert trust.trusted_uids() >= {os.getuid(), 0}


@pytest.mark.slow
@pytest.mark.parametrize("files", [GPU_FILES, LEGACY_FILES], ids=["compose", "compose+legacy"])
def test_docker_compose_resolves_the_same_users(files: tuple[str, ...]) -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose v2 here (the test extra installs one on Linux x86-64; `config` needs no daemon)")
    profiles = ("vllm", "vllm-gpus")
    args = [*cli, "--env-file", str(ENV_EXAMPLE), *(a for f in files for a in ("-f", str(DOCKER / f)))]
    args += [a for p in profiles for a in ("--profile", p)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_", "COMPOSE_"))}
    env["KVPOOL_TOKEN"] = TOKEN
    done = subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout)["services"]
    ours = model(files, profiles=profiles)["services"]
    for name, service in theirs.items():
        assert service.get("environment", {}).get("KVPOOL_TOKEN") == TOKEN, f"{name} does not get the pool's token"
    assert set(theirs) == set(ours)
    for name, service in ours.items():
        assert theirs[name].get("user") == service["user"], name
        assert theirs[name].get("environment", {}).get(trust.POOL_UID_ENV) == env_of(service).get(trust.POOL_UID_ENV)
