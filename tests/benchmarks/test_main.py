"""``kvpool bench``: the suites it offers, and a renamed suite's old name."""

from __future__ import annotations

import pytest

from kvpool.benchmarks.__main__ import RENAMED, SUITES, main


def test_a_renamed_suite_runs_under_its_old_name_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert RENAMED == {"lease": "slab"} and "lease" not in SUITES
    with pytest.raises(SystemExit) as exit_:
        main(["lease", "--help"])
    assert exit_.value.code == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: kvpool bench slab") and "slab: alloc, free and handoffs" in out
    assert "the suite 'lease' is now 'slab' ('lease' is deprecated)" in err


def test_the_suites_list_names_each_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert "slab" in listed and "lease" not in listed and len(listed) == len(set(listed))
