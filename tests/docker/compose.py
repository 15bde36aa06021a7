"""Reads docker/compose*.yaml the way Docker Compose does, as far as kvpool's files need it.

Covers: YAML anchors and merge keys, the ``!reset`` and ``!override`` tags, ``${VAR}``, ``${VAR:-default}``
and the other interpolation forms, and merging an override file onto the base (mappings merge key by key).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft7Validator

HERE = Path(__file__).parent
ROOT = HERE.parents[1]
DOCKER = ROOT / "docker"
SCHEMA = HERE / "compose-spec.json"

GPU_FILES = ("compose.yaml",)
CPU_FILES = ("compose.yaml", "compose.cpu.yaml")
LEGACY_FILES = ("compose.yaml", "compose.legacy.yaml")


def tool(name: str) -> str | None:
    """A command from this Python's scripts directory (where the test extra installs it), else from PATH."""
    return shutil.which(name, path=sysconfig.get_path("scripts")) or shutil.which(name)


class Reset:
    """``!reset``: drop whatever the files before this one set here."""


class Override:
    """``!override``: replace instead of merge."""

    def __init__(self, value: Any) -> None:
        self.value = value


class ComposeLoader(yaml.SafeLoader):
    pass


def _construct(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)


ComposeLoader.add_constructor("!reset", lambda loader, node: Reset())
ComposeLoader.add_constructor("!override", lambda loader, node: Override(_construct(loader, node)))


def read(name: str) -> dict[str, Any]:
    return yaml.load((DOCKER / name).read_text(), Loader=ComposeLoader)


def strip_tags(value: Any) -> Any:
    """One file on its own, as the schema sees it: resets gone, overrides unwrapped."""
    if isinstance(value, dict):
        return {k: strip_tags(v) for k, v in value.items() if not isinstance(v, Reset)}
    if isinstance(value, list):
        return [strip_tags(v) for v in value if not isinstance(v, Reset)]
    if isinstance(value, Override):
        return strip_tags(value.value)
    return value


def merge(base: Any, over: Any, path: str = "") -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for key, value in over.items():
            if isinstance(value, Reset):
                out.pop(key, None)
            elif isinstance(value, Override) or key not in out:
                out[key] = strip_tags(value)
            else:
                out[key] = merge(out[key], value, f"{path}.{key}")
        return out
    if isinstance(base, list) and isinstance(over, list):
        raise NotImplementedError(f"{path}: compose merges lists per key; teach tests/docker/compose.py how")
    return strip_tags(over)


_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def _substitute(match: re.Match[str], env: dict[str, str]) -> str:
    if match["escaped"]:
        return "$"
    name = match["name"] or match["bare"]
    op, arg, value = match["op"], match["arg"] or "", env.get(name)
    present = value is not None and (value != "" or not (op or "").startswith(":"))
    if op in (":-", "-"):
        return value if present else arg
    if op in (":+", "+"):
        return arg if present else ""
    if op in (":?", "?") and not present:
        raise ValueError(f"${{{name}}} is required: {arg}")
    return value or ""


def interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, str):
        return _VAR.sub(lambda m: _substitute(m, env), value)
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    return value


def variables(value: Any) -> set[str]:
    """Names used in ``${...}`` anywhere in a file."""
    if isinstance(value, str):
        return {m["name"] or m["bare"] for m in _VAR.finditer(value) if not m["escaped"]}
    if isinstance(value, dict):
        return set().union(*(variables(v) for v in value.values()))
    if isinstance(value, list | tuple):
        return set().union(*(variables(v) for v in value))
    if isinstance(value, Override):
        return variables(value.value)
    return set()


def read_dotenv(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


def model(files: tuple[str, ...], env: dict[str, str] | None = None, profiles: tuple[str, ...] = ()) -> dict[str, Any]:
    """The project as ``docker compose -f docker/<file> ... [--profile P] config`` resolves it: a service with
    profiles only when one of them is asked for."""
    merged: Any = strip_tags(read(files[0]))
    for name in files[1:]:
        merged = merge(merged, read(name))
    doc = interpolate(merged, env or {})
    doc["services"] = {
        k: v for k, v in doc["services"].items() if not v.get("profiles") or set(v["profiles"]) & set(profiles)
    }
    return doc


@functools.cache
def validator() -> Draft7Validator:
    return Draft7Validator(json.loads(SCHEMA.read_text()))


def schema_errors(doc: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator().iter_errors(doc)]
