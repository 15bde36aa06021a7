"""The layers run one way, ``kvpool`` <- ``server`` <- ``workers``, ``benchmarks``, no modules import each other in
a circle, and the whole installs under one name.

Checked on the source. Layers: every import statement, at module level or inside a function, and every string that
names a higher layer's module (``importlib.import_module("kvpool.server.x")`` is an upward import too). Circles:
every import statement, at module level, under ``if TYPE_CHECKING:`` or inside a function (a deferred import is a
dependency all the same: it only moves the moment it is paid), and every ``import_module`` of a literal name; a
string that merely mentions a module (a docstring) is no edge.
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


def module_files() -> dict[str, Path]:
    """Every module of the four folders, by its installed name (``kvpool.server.books.pool``: server/books/pool.py)."""
    found = {}
    for folder, (package, _) in LAYERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join([package, *(p for p in parts if p != "__init__")])] = path
    return found


def imports_of(name: str, path: Path, known: set[str] | dict[str, Path]) -> set[str]:
    """The modules among ``known`` that module ``name`` (at ``path``) imports, anywhere in it: ``from x import y``
    counts as importing ``x.y`` where that is a module, else ``x``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif by_name(node):
            names = [node.args[0].value]  # type: ignore[attr-defined]
        out.update(n for n in names if n in known and n != name)
    return out


def by_name(node: ast.AST) -> bool:
    """Whether ``node`` is an ``import_module("literal")`` call."""
    if not isinstance(node, ast.Call) or getattr(node.func, "attr", getattr(node.func, "id", "")) != "import_module":
        return False
    return bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other in a circle (strongly connected, more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, files) for name, path in files.items()}


def test_no_modules_import_each_other_in_a_circle():
    assert circles(import_graph()) == []


def test_the_circle_check_finds_deferred_and_type_only_imports(tmp_path):
    """The checker itself: a circle closed by a function's import, by one made for type checking only, or by an
    import by name is one; a module a docstring mentions is no import."""
    sources = {
        "a": "from kvpool.b import x\n",
        "b": "def f():\n    from kvpool.c import y\n",
        "c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvpool import a\n",
        "d": "import importlib\nimportlib.import_module('kvpool.a')\n",
        "e": "'see kvpool.c'\nfrom kvpool import d\n",
    }
    for name, text in sources.items():
        (tmp_path / f"{name}.py").write_text(text)
    known = {f"kvpool.{n}" for n in sources}
    graph = {f"kvpool.{n}": imports_of(f"kvpool.{n}", tmp_path / f"{n}.py", known) for n in sources}
    assert graph["kvpool.d"] == {"kvpool.a"} and graph["kvpool.e"] == {"kvpool.d"}
    assert circles(graph) == [["kvpool.a", "kvpool.b", "kvpool.c"]]
    graph["kvpool.a"].add("kvpool.e")
    assert circles(graph) == [["kvpool.a", "kvpool.b", "kvpool.c", "kvpool.d", "kvpool.e"]]


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


def test_the_core_and_the_pool_never_reach_into_the_integrations():
    """``kvpool.integrations`` (the vLLM connector) stands on the client; nothing below it, in kvpool/, server/ or
    workers/, imports it or names it."""
    bad = []
    for folder in ("kvpool", "server", "workers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.is_relative_to(ROOT / "kvpool" / "integrations"):
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            bad += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in modules_named(tree)
                    if name == "kvpool.integrations" or name.startswith("kvpool.integrations.")]  # fmt: skip
    assert bad == []


#: what the pool's books (server/books/) may never import: the rest of the server, and the machinery around it
NOT_IN_BOOKS = ("kvpool.server", "torch", "fastapi", "starlette", "uvicorn", "httpx", "nixl")


def test_the_books_stand_on_nothing_but_kvpool_and_each_other():
    """server/books/ is the pool's pure-Python core: transports, tiers, slabs, events and remote reads stand on it,
    and it on none of them (nor on torch or HTTP), so it is tested with plain function calls."""
    bad = []
    for path in sorted((ROOT / "server" / "books").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = [(n.lineno, a.name) for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imported += [(n.lineno, n.module) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        bad += [f"{path.relative_to(ROOT)}:{line}: {name}" for line, name in imported
                if not name.startswith("kvpool.server.books")
                and any(name == x or name.startswith(x + ".") for x in NOT_IN_BOOKS)]  # fmt: skip
    assert bad == []


def test_the_check_catches_an_upward_import(tmp_path):
    """The checker itself: a lazy import, a from-import and an import by name all count."""
    source = (
        "def f():\n    from kvpool.server.books.pool import Pool\n"
        "import importlib\nimportlib.import_module('kvpool.workers.demo')\n"
        "from kvpool.benchmarks import harness\n"
    )
    names = [name for _, name in modules_named(ast.parse(source))]
    assert "kvpool.server.books.pool" in names
    assert "kvpool.workers.demo" in names
    assert "kvpool.benchmarks" in names


#: test folder -> the module folder it mirrors, and the prefix its files' names add
MIRRORS = {
    "tests": ("kvpool", ""),
    "tests/server": ("server", ""),
    **{f"tests/server/{p}": (f"server/{p}", "") for p in ("books", "events", "remote", "transports")},
    "tests/workers": ("workers", ""),
    "tests/benchmarks": ("benchmarks", ""),
    "tests/integrations": ("kvpool/integrations/vllm", "vllm_"),
}
#: test files that check what several modules do together, each named for what it checks (see tests/__init__.py)
SUITES = {
    "tests/test_layers.py": "the tree itself: layers, circles, this layout, the distribution",
    "tests/test_readme.py": "the README's worker example run from its text, and every link of the docs",
    "tests/test_slab.py": "kvpool/slab/ as a whole: a SlabClient's reservation, ring and box against a pool",
    "tests/server/test_access.py": "who can reach the pool and with what",
    "tests/server/test_attacks.py": "what an attacker on the node tries",
    "tests/server/test_bad_input.py": "bad input over both transports",
    "tests/server/test_docs.py": "the API's pages served by the pool itself",
    "tests/server/test_fuzz.py": "schemathesis against the served schema",
    "tests/server/test_kv_events.py": "a router rebuilding the index from a real pool's events",
    "tests/server/test_multi_arena.py": "a pool of several arenas",
    "tests/server/test_stale.py": "stale ids refused on every way a call comes",
    "tests/workers/test_flow.py": "the workers as processes around a pool",
    "tests/integrations/test_vllm_drift.py": "the installed vLLM wheel against every private symbol a generation names",
    "tests/workers/test_gpu.py": "the Triton kernels on CUDA",
    "tests/workers/test_host_tier.py": "the same tokens with and without the host tier",
    "tests/workers/test_transformers.py": "the model against Hugging Face transformers",
    "tests/benchmarks/test_smoke.py": "every suite end to end",
    "tests/integrations/test_vllm_layerwise.py": "layer-by-layer loads against a step's",
    "tests/integrations/test_vllm_sides.py": "the connector's two sides against a pool",
}


def test_tests_mirror_the_modules():
    """Each test file is named for the module it tests, in the folder that mirrors the module's, or is a listed
    suite; a listed suite that is gone is taken off the list."""
    stray = []
    for tests, (folder, prefix) in MIRRORS.items():
        modules = {p.stem.strip("_") for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
        for path in sorted((ROOT / tests).glob("test_*.py")):
            name = str(path.relative_to(ROOT))
            stem = path.stem.removeprefix("test_")
            named = stem.startswith(prefix) and any(
                stem[len(prefix) :] == m or stem[len(prefix) :].startswith(m + "_") for m in modules
            )
            if not named and name not in SUITES:
                stray.append(name)
    assert stray == [], "name each for its module (tests/__init__.py says how), or list it in SUITES"
    assert [s for s in SUITES if not (ROOT / s).exists()] == []


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


@pytest.mark.slow
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
    assert {"kvpool/server/books/pool.py", "kvpool/workers/demo.py", "kvpool/benchmarks/harness.py"} <= names
    # a subpackage missing from pyproject's packages list is left out of every non-editable install (the images)
    modules = {
        m.replace(".", "/") + ("/__init__.py" if p.name == "__init__.py" else ".py") for m, p in module_files().items()
    }
    missing = sorted(modules - names)
    assert not missing, f"add their packages to [tool.setuptools] packages in pyproject.toml: {missing}"


def test_every_package_of_the_tree_is_one_that_pyproject_installs():
    """setuptools installs only the packages pyproject lists: a folder left off ships in an editable install and is
    missing from the wheel (``kvpool.integrations.vllm.generations`` once was)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert found == listed


def test_the_license_file_is_the_apache_2_0_that_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
