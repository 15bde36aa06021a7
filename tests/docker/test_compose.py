"""docker/compose.yaml: valid Compose, and the settings that sharing the arena between containers depends on.

The default VMM arena goes to the workers as an fd over the pool's Unix socket, so they keep PID namespaces of
their own; legacy CUDA IPC handles (compose.legacy.yaml) fail with "invalid device context" when exporter and
importer have the same namespace-local PID, so there the workers share the pool's PID namespace. The CPU arena
and IPC events need the pool's /dev/shm, so the workers share its IPC namespace; every container reserves the
arena's GPU. These tests keep all of that, the socket volume, the health check and the start order from being
dropped by accident.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from typing import Any

import pytest
import yaml

from kvpool.server.config import PoolSettings

from .compose import (
    CPU_FILES,
    DOCKER,
    GPU_FILES,
    LEGACY_FILES,
    ROOT,
    model,
    read,
    read_dotenv,
    schema_errors,
    strip_tags,
    tool,
    variables,
)

POOL = "kvpool"
WORKERS = ("prefill", "decode")
SERVICES = (POOL, *WORKERS)
SOCKET_DIR = "/run/kvpool"
SOCKET = f"{SOCKET_DIR}/kvpool.sock"
URL = f"unix://{SOCKET}"
ENV_EXAMPLE = DOCKER / ".env.example"

# set to fixed values by compose; every other KVPOOL_* a container gets is a PoolSettings field
FIXED = {"KVPOOL_SOCKET", "KVPOOL_URL"}
NOT_PASSED = {"shm_dir": "the arena file must be in the /dev/shm the workers share"}

FILE_SETS = pytest.mark.parametrize(
    "files", [GPU_FILES, CPU_FILES, LEGACY_FILES], ids=["compose", "compose+cpu", "compose+legacy"]
)
ENVS = {"defaults": {}, "env-example": read_dotenv(ENV_EXAMPLE)}


def env_of(service: dict[str, Any]) -> dict[str, Any]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] if "=" in item else (item, None) for item in env)
    return env


def resolved_env(service: dict[str, Any], dotenv: dict[str, str]) -> dict[str, str]:
    """What the container gets: a variable listed without a value comes from .env, or is left out."""
    out = {}
    for key, value in env_of(service).items():
        value = dotenv.get(key) if value is None else value
        if value is not None:
            out[key] = str(value)
    return out


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    return reservations.get("devices") or []


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """target -> (type, source)"""
    out = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            source, target = volume.split(":")[:2]
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
        else:
            source, target, kind = volume.get("source", ""), volume["target"], volume.get("type", "volume")
        out[target] = (kind, source)
    return out


@FILE_SETS
@pytest.mark.parametrize("env", ENVS.values(), ids=ENVS.keys())
def test_valid_compose_spec(files: tuple[str, ...], env: dict[str, str]) -> None:
    assert schema_errors(model(files, env)) == []


@pytest.mark.parametrize("name", ["compose.yaml", "compose.cpu.yaml", "compose.legacy.yaml"])
def test_each_file_valid_on_its_own(name: str) -> None:
    assert schema_errors(strip_tags(read(name))) == []


def test_schema_rejects_what_compose_rejects() -> None:
    doc = model(GPU_FILES)
    del gpu_devices(doc["services"][POOL])[0]["capabilities"]
    doc["services"]["prefill"]["depends_on"][POOL]["condition"] = "healthy"
    doc["services"]["decode"]["pids"] = 1
    errors = schema_errors(doc)
    assert any("'capabilities' is a required property" in e for e in errors), errors
    assert any(e.startswith("services/prefill/depends_on: ") for e in errors), errors
    assert any(e.startswith("services/decode: 'pids'") for e in errors), errors


@FILE_SETS
def test_services(files: tuple[str, ...]) -> None:
    services = model(files)["services"]
    assert set(services) == set(SERVICES)
    assert services[POOL]["command"] == ["serve"]
    for worker in WORKERS:
        assert services[worker]["command"][:2] == ["worker", worker]
        assert services[worker]["image"] == services[POOL]["image"]


@FILE_SETS
def test_workers_share_the_pools_ipc_namespace(files: tuple[str, ...]) -> None:
    services = model(files)["services"]
    pool = services[POOL]
    for worker in WORKERS:
        ipc = services[worker].get("ipc")
        assert ipc in (f"service:{POOL}", "host"), f"{worker}: the arena's /dev/shm is the pool's"
        assert pool.get("ipc") == ("host" if ipc == "host" else "shareable")
    if pool.get("ipc") == "shareable":
        assert pool.get("shm_size"), "the CPU arena lives in the pool's /dev/shm: size it"


@pytest.mark.parametrize("files", [GPU_FILES, CPU_FILES], ids=["compose", "compose+cpu"])
def test_with_the_default_handle_workers_keep_their_own_pid_namespaces(files: tuple[str, ...]) -> None:
    services = model(files, ENVS["env-example"])["services"]
    for name in SERVICES:
        assert services[name].get("pid") is None, f"{name}: the VMM arena needs no shared PID namespace"
        assert resolved_env(services[name], ENVS["env-example"]).get("KVPOOL_ARENA_HANDLE", "auto") == "auto"


def test_legacy_handles_put_the_workers_in_the_pools_pid_namespace() -> None:
    services = model(LEGACY_FILES)["services"]
    pool = services[POOL]
    assert env_of(pool)["KVPOOL_ARENA_HANDLE"] == "legacy"
    for worker in WORKERS:
        pid = services[worker].get("pid")
        assert pid in (f"service:{POOL}", "host"), f"{worker}: same-PID CUDA IPC fails without a shared PID namespace"
        if pid == "host":
            assert pool.get("pid") == "host"
        else:
            assert pool.get("pid") is None, "the pool keeps the namespace the workers join"


@pytest.mark.parametrize("env", [{}, {"KVPOOL_GPUS": "GPU-5c3a9e8e-0000-4000-8000-000000000000"}], ids=["0", "uuid"])
def test_every_container_reserves_the_arena_gpu(env: dict[str, str]) -> None:
    services = model(GPU_FILES, env)["services"]
    reserved = set()
    for name in SERVICES:
        (device,) = gpu_devices(services[name])
        assert device["driver"] == "nvidia"
        assert "gpu" in device["capabilities"]
        reserved.add(tuple(device["device_ids"]))
    assert reserved == {(env.get("KVPOOL_GPUS", "0"),)}, "every container must see the GPU the arena is on"


def test_cpu_profile_runs_without_gpus() -> None:
    services = model(CPU_FILES, {"KVPOOL_BACKEND": "cuda"})["services"]
    for name in SERVICES:
        assert gpu_devices(services[name]) == []
        assert env_of(services[name])["KVPOOL_BACKEND"] == "cpu"


def test_cpu_override_has_no_yaml_aliases() -> None:
    events = yaml.parse((DOCKER / "compose.cpu.yaml").read_text())
    assert not any(isinstance(e, yaml.AliasEvent) for e in events), "compose ignores !reset under an alias"


@FILE_SETS
def test_socket_on_a_shared_named_volume(files: tuple[str, ...]) -> None:
    doc = model(files)
    services = doc["services"]
    sources = set()
    for name in SERVICES:
        kind, source = mounts(services[name])[SOCKET_DIR]
        assert kind == "volume"
        sources.add(source)
        assert env_of(services[name])["KVPOOL_URL"] == URL
    (source,) = sources
    assert source in doc["volumes"]
    assert env_of(services[POOL])["KVPOOL_SOCKET"] == SOCKET


@FILE_SETS
def test_pool_health_check_and_start_order(files: tuple[str, ...]) -> None:
    services = model(files)["services"]
    check = services[POOL]["healthcheck"]
    assert not check.get("disable")
    assert check["test"] == ["CMD", "kvpool", "health", "--url", URL]
    for worker in WORKERS:
        assert services[worker]["depends_on"][POOL]["condition"] == "service_healthy"


@FILE_SETS
@pytest.mark.parametrize("env", ENVS.values(), ids=ENVS.keys())
def test_tcp_stays_on_loopback(files: tuple[str, ...], env: dict[str, str]) -> None:
    for name, service in model(files, env)["services"].items():
        assert service.get("network_mode") != "host", name
        for port in service.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port}"
    assert env_of(model(files, env)["services"][POOL])["KVPOOL_HOST"] == "127.0.0.1"


def test_settings_reach_the_containers() -> None:
    passed = {k for name in SERVICES for k in env_of(model(GPU_FILES)["services"][name]) if k.startswith("KVPOOL_")}
    fields = {f"KVPOOL_{name.upper()}" for name in PoolSettings.model_fields if name not in NOT_PASSED}
    missing = fields - passed - FIXED
    assert not missing, f"add {sorted(missing)} to the environment in docker/compose.yaml and to .env.example"
    unknown = passed - fields - FIXED
    assert not unknown, f"{sorted(unknown)} in docker/compose.yaml are no kvpool settings"


def test_env_example_documents_every_variable() -> None:
    documented = {
        line.lstrip("#").split("=", 1)[0].strip()
        for line in ENV_EXAMPLE.read_text().splitlines()
        if re.match(r"#?\s*[A-Z][A-Z0-9_]*=", line)
    }
    used = set()
    for name in ("compose.yaml", "compose.cpu.yaml"):
        doc = read(name)
        used |= variables(doc)
        for service in strip_tags(doc)["services"].values():
            used |= {k for k, v in env_of(service).items() if v is None}
    assert used - documented == set(), "document these in docker/.env.example"
    assert documented - used - FIXED == set(), "docker/.env.example names variables compose does not use"


def _compose_cli() -> list[str] | None:
    for name, *rest in (["docker", "compose"], ["docker-compose"]):
        path = tool(name)
        if path is None:
            continue
        cli = [path, *rest]
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            done = subprocess.run([*cli, "version", "--short"], capture_output=True, text=True, timeout=10)
            if done.returncode == 0 and done.stdout.strip().lstrip("v").split(".")[0] == "2":
                return cli
    return None


@pytest.mark.slow
@FILE_SETS
def test_docker_compose_config_agrees(files: tuple[str, ...]) -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no Docker Compose v2 here (the test extra installs one on Linux x86-64; `config` needs no daemon)")
    args = [*cli, "--env-file", str(ENV_EXAMPLE)]
    for name in files:
        args += ["-f", str(DOCKER / name)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_", "COMPOSE_"))}
    done = subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout)["services"]
    ours = model(files, ENVS["env-example"])["services"]
    for name in SERVICES:
        for key in ("command", "pid", "ipc", "image"):
            assert theirs[name].get(key) == ours[name].get(key), (name, key)
        assert gpu_devices(theirs[name]) == gpu_devices(ours[name]), name
        assert resolved_env(theirs[name], {}) == resolved_env(ours[name], ENVS["env-example"]), name
        assert mounts(theirs[name])[SOCKET_DIR] == mounts(ours[name])[SOCKET_DIR]
    assert theirs[POOL]["healthcheck"]["test"] == ours[POOL]["healthcheck"]["test"]
    for worker in WORKERS:
        assert theirs[worker]["depends_on"][POOL]["condition"] == "service_healthy"


def _pool_commands() -> list[list[str]]:
    pool = model(GPU_FILES)["services"][POOL]
    return [pool["command"], pool["healthcheck"]["test"][2:]]


@pytest.mark.parametrize("argv", _pool_commands(), ids=lambda argv: argv[0])
def test_pool_commands_exist(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    cli = pytest.importorskip("kvpool.cli")
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0, capsys.readouterr().err


def test_default_layout_fits_the_workers_default_model() -> None:
    kvcache = pytest.importorskip("kvpool.workers.kvcache")
    cli = pytest.importorskip("kvpool.workers.cli")
    services = model(GPU_FILES)["services"]
    for worker in WORKERS:
        assert "--random-model" in services[worker]["command"]
    env = {k.removeprefix("KVPOOL_").lower(): v for k, v in env_of(services[POOL]).items() if v is not None}
    layout = PoolSettings(**{k: v for k, v in env.items() if k in PoolSettings.model_fields}).layout
    kvcache.check_layout(cli.TINY, layout)


@pytest.mark.parametrize("worker", WORKERS)
def test_worker_commands_exist(worker: str, capsys: pytest.CaptureFixture[str]) -> None:
    cli = pytest.importorskip("kvpool.cli")
    command = model(GPU_FILES)["services"][worker]["command"]
    try:
        with pytest.raises(SystemExit) as done:
            cli.main([*command, "--help"])
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("workers"):
            raise
        pytest.skip(f"{exc.name} is not there yet")
    assert done.value.code == 0, capsys.readouterr().err


def test_vllm_profile_runs_two_engines_beside_the_pool_and_a_proxy() -> None:
    services = model(GPU_FILES, profiles=("vllm",))["services"]
    assert schema_errors(model(GPU_FILES, profiles=("vllm",))) == []
    for name in ("vllm-prefill", "vllm-decode"):
        engine = services[name]
        assert engine["ipc"] == f"service:{POOL}" and engine.get("pid") is None  # the VMM arena's fd needs no PID
        legacy = model(LEGACY_FILES, profiles=("vllm",))["services"][name]
        assert legacy["pid"] == f"service:{POOL}", "a legacy handle needs the pool's PID namespace"
        assert engine["environment"]["KVPOOL_URL"] == URL
        assert "kvpool.integrations.vllm" in engine["environment"]["VLLM_KV"]
        assert gpu_devices(engine) == gpu_devices(services[POOL])
    assert services["vllm-proxy"]["entrypoint"][-1] == "kvpool.integrations.vllm.proxy"
