"""The layers run one way, ``kvpool`` <- ``server`` <- ``workers``, ``benchmarks``, and install under one name.

Checked on the source: every import statement, at module level or inside a function, and every string that
names a higher layer's module (``importlib.import_module("kvpool.server.x")`` is an upward import too).
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: folder -> the installed package it becomes, and the packages it must never reach
LAYERS = {
    "kvpool": ("kvpool", ("kvpool.server", "kvpool.workers", "kvpool.benchmarks")),
    "server": ("kvpool.server", ("kvpool.workers", "kvpool.benchmarks")),
    "workers": ("kvpool.workers", ("kvpool.benchmarks",)),
    "benchmarks": ("kvpool.benchmarks", ()),
}
#: the folders' own names, which an installed kvpool must never offer as top-level packages
GENERIC = ("server", "workers", "benchmarks")


def modules_named(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an import statement or a string literal in ``tree`` names, with its line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [(node.lineno, m) for m in re.findall(r"\b[a-z_]+(?:\.[a-z_0-9]+)+", node.value)]
    return found


def violations(folder: str) -> list[str]:
    _, forbidden = LAYERS[folder]
    generic = tuple(g for g in GENERIC if g != folder)
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, name in modules_named(tree):
            upward = any(name == f or name.startswith(f + ".") for f in forbidden)
            bare = isinstance(name, str) and name.split(".")[0] in generic and name.count(".") >= 1
            if upward or (bare and not name.startswith("kvpool.")):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    return bad


@pytest.mark.parametrize("folder", list(LAYERS))
def test_no_module_reaches_up_or_by_a_folder_name(folder):
    assert violations(folder) == []


def test_the_check_catches_an_upward_import(tmp_path):
    """The checker itself: a lazy import, a from-import and an import by name all count."""
    source = (
        "def f():\n    from kvpool.server.pool import Pool\n"
        "import importlib\nimportlib.import_module('kvpool.workers.demo')\n"
        "from kvpool.benchmarks import harness\n"
    )
    names = [name for _, name in modules_named(ast.parse(source))]
    assert "kvpool.server.pool" in names
    assert "kvpool.workers.demo" in names
    assert "kvpool.benchmarks" in names


def test_the_installed_distribution_has_one_top_level_name():
    dist = importlib.metadata.distribution("kvpool")
    assert (dist.read_text("top_level.txt") or "").split() == ["kvpool"]
    for folder, (package, _) in LAYERS.items():
        module = importlib.import_module(package)
        assert Path(module.__file__).parent.name in {folder, package.rsplit(".", 1)[-1]}


def test_the_commands_are_registered_by_their_components():
    from kvpool.commands import registered

    targets = {name: cmd.target.split(":")[0] for name, cmd in registered().items()}
    assert targets == {
        "serve": "kvpool.server.main",
        "demo": "kvpool.workers.demo",
        "worker": "kvpool.workers.commands",
        "bench": "kvpool.benchmarks.__main__",
    }


def test_a_built_wheel_adds_nothing_but_kvpool_to_site_packages(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"  # a copy, so that the build leaves nothing in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md", *LAYERS):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")} if name in LAYERS else {}))
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*pip, str(src)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("kvpool-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"kvpool"}
    assert {"kvpool/server/pool.py", "kvpool/workers/demo.py", "kvpool/benchmarks/harness.py"} <= names


def test_the_license_file_is_the_apache_2_0_that_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
