"""``kvpool bench``: the suites it offers, and a renamed suite's old name."""

from __future__ import annotations

import pytest

from kvpool.benchmarks.__main__ import SUITES, main


def test_the_suite_from_before_the_slab_table_was_named_is_gone(capsys: pytest.CaptureFixture[str]) -> None:
    assert "lease" not in SUITES and main(["lease"]) == 2
    assert "no suite 'lease'" in capsys.readouterr().err


def test_the_suites_list_names_each_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert "slab" in listed and "lease" not in listed and len(listed) == len(set(listed))
