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


def test_a_timeline_is_written_at_shutdown_with_every_threads_events(tmp_path: Path) -> None:
    """Stamps stay in memory while the engine runs (writing them cost its threads microseconds each)."""
    import threading

    profile = Profile(str(tmp_path), "worker")
    profile.add("load", 1.0)
    profile.maybe_write()  # the sums go out as before; the timeline waits
    assert not list(tmp_path.glob("timeline-*.jsonl"))

    def stamp(name: str) -> None:
        for i in range(500):
            profile.mark(name, i=i)

    threads = [threading.Thread(target=stamp, args=(f"k{j}",)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    profile.maybe_write(force=True)
    events = [json.loads(line) for line in next(tmp_path.glob("timeline-*.jsonl")).read_text().splitlines()]
    assert len(events) == 2000
    for j in range(4):
        assert [e["i"] for e in events if e["k"] == f"k{j}"] == list(range(500))
    assert json.loads(next(tmp_path.glob("worker-*.json")).read_text())["load"]["n"] == 1
