"""The README's worker example runs as written, against the pool its own command starts, and prints what the README
says it prints; and every relative link in README.md and docs/*.md names a file (and a heading) that exists."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
import unicodedata
from pathlib import Path

import pytest

from kvpool.server.launch import child_env, spawn

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_HEADING = "## Using it from a worker"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced_blocks(section: str) -> list[tuple[str, str]]:
    """``(language, body)`` of each fenced block in ``section``, in order."""
    return [(m[1], m[2]) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", section, re.M | re.S)]


def readme_section(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def the_example() -> tuple[str, str, str]:
    """The section's first bash block (the pool's command), its first python block and the text block after it."""
    blocks = fenced_blocks(readme_section(EXAMPLE_HEADING))
    langs = [lang for lang, _ in blocks]
    assert langs[:3] == ["bash", "python", "text"], f"{EXAMPLE_HEADING}: blocks are {langs}"
    return blocks[0][1], blocks[1][1], blocks[2][1]


@pytest.mark.slow
def test_the_worker_example_runs_as_written_against_the_pool_it_starts() -> None:
    serve, code, expected = the_example()
    (command,) = [line.split("#")[0].strip() for line in serve.splitlines() if line.split("#")[0].strip()]
    argv = shlex.split(command)
    assert argv[:2] == ["kvpool", "serve"], command
    # The defaults as a user has them, in a runtime directory of this test's own: the same default socket for pool
    # and example, and no clash with a pool on this machine. TCP is off (its default port may be taken).
    runtime = Path(tempfile.mkdtemp(prefix="kvp-rd-"))
    env = {k: v for k, v in child_env().items() if not k.startswith("KVPOOL_")}
    env.update(XDG_RUNTIME_DIR=str(runtime), KVPOOL_PORT="0")
    sock = runtime / "kvpool" / "kvpool.sock"
    pool = spawn(argv, socket=sock, port=0, log=runtime / "pool.log", env=env, workdir=runtime)
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=runtime, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        stats = pool.stats()
    finally:
        log, rc = pool.output(), pool.stop()
    assert done.returncode == 0, f"the README's example failed:\n{done.stdout}\n{done.stderr}\n{log}"
    assert done.stdout == expected, f"printed:\n{done.stdout}\nthe README says:\n{expected}"
    books = stats["free"] + stats["in_use"] + stats["cached"]
    assert (stats["in_use"], stats["sessions"], books) == (0, 0, stats["num_blocks"]), stats
    assert rc == 0, log


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped but hyphens and underscores, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in without_code(page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            base = slug(m[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def without_code(text: str) -> str:
    return re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)


def links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", without_code(page.read_text()))
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        rel = dest.relative_to(ROOT).as_posix()
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_slugs_are_githubs() -> None:
    assert (
        slug("Tokens to the bit: batch invariance (`invariance.py`)")
        == "tokens-to-the-bit-batch-invariance-invariancepy"
    )
    assert slug("e2e scenario 4: the host tier (H100)") == "e2e-scenario-4-the-host-tier-h100"
    assert slug("The arena handle is a key to all the KV") == "the-arena-handle-is-a-key-to-all-the-kv"
    assert (
        slug("Slabs: alloc, free and handoffs with no round trip") == "slabs-alloc-free-and-handoffs-with-no-round-trip"
    )


def install_lines(page: Path) -> list[str]:
    """Each ``pip install`` and ``docker/install.sh`` command a page tells a reader to run, in code or in a block."""
    text = page.read_text()
    return [m[0] for m in re.finditer(r"(?:pip install|bash docker/install\.sh)[^`\n]*", text)]


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_install_lines_install_from_a_checkout(page: Path) -> None:
    # kvpool is on no package index: a line naming the package ("kvpool", "kvpool[vllm]") fails on a fresh machine
    for line in install_lines(page):
        words = shlex.split(line.split("#")[0].split("&&")[0])
        targets = [w for w in words[2:] if not w.startswith("-") and "torch" not in w]
        assert targets and all(t.startswith(".") for t in targets), f"{page.name}: {line!r} installs no checkout"


def test_the_vllm_extra_names_the_tested_range() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (vllm,) = extras["vllm"]
    assert vllm.replace(" ", "") == "vllm>=0.26,<0.27", "resident and copy mode are tested with vLLM 0.26 only"
    assert "vLLM 0.26" in (ROOT / "docs" / "vllm.md").read_text()
