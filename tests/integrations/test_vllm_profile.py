"""The connector's profile: the timeline a benchmark reads stops growing at its limit, and says where."""

from __future__ import annotations

import json
from pathlib import Path

from kvpool.integrations.vllm.profile import Profile


def test_a_timeline_stops_at_its_limit_and_says_so(tmp_path: Path) -> None:
    profile = Profile(str(tmp_path), "scheduler", max_events=3)
    for i in range(10):
        profile.mark("plan", loads=i)
    profile.maybe_write(force=True)
    events = [json.loads(line) for line in next(tmp_path.glob("timeline-scheduler-*.jsonl")).read_text().splitlines()]
    assert [e["k"] for e in events] == ["plan", "plan", "timeline_full"]
    assert [e.get("loads") for e in events[:2]] == [0, 1]


def test_without_a_directory_nothing_is_written(tmp_path: Path) -> None:
    profile = Profile(None, "worker")
    profile.mark("plan")
    profile.add("load", 1.0)
    profile.maybe_write(force=True)
    assert not profile.on and not list(tmp_path.iterdir())
