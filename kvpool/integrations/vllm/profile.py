"""Where a connector's time goes on an engine, for benchmarks: counters and summed milliseconds per kind of
work, written as JSON to ``profile_dir`` (at most twice a second, and at shutdown) when that setting is given,
and a timeline of the connector's events on the engine core's monotonic clock (the clock of vLLM's own request
timestamps), so that a request's time in vLLM's queue and in its first step can be laid beside what the connector
did meanwhile.

The engine core runs in its own process, so a file is how a benchmark reads what the connector saw. The timeline's
events are kept in memory as they happen and written out at shutdown (or when many have piled up): an event costs
a tuple appended on the thread that stamps it, where formatting and writing it there cost the engine's threads
several microseconds each, at the very moments a benchmark times.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

#: events a timeline keeps (about 100 bytes each); past them it says so once and stops growing
MAX_TIMELINE_EVENTS = 1_000_000
#: events held in memory before they are written out on the thread that stamps the next one
FLUSH_EVENTS = 50_000


class Profile:
    def __init__(self, directory: str | None, side: str, max_events: int = MAX_TIMELINE_EVENTS) -> None:
        self.path = Path(directory) / f"{side}-{os.getpid()}.json" if directory else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._timeline = self.path.with_name(f"timeline-{side}-{os.getpid()}.jsonl") if self.path else None
        self._events: list[tuple[float, str, float | None, dict[str, Any]]] = []
        self._sums: dict[str, list[float]] = {}  # kind -> [count, total ms, max ms]
        self._lock = threading.Lock()
        self._written = 0.0
        self._events_left = max_events
        self.pending: list[tuple[str, Any, Any]] = []  # (kind, start event, end event): GPU times, read when done

    @property
    def on(self) -> bool:
        return self.path is not None

    def add(self, kind: str, ms: float) -> None:
        if self.path is None:
            return
        with self._lock:
            s = self._sums.setdefault(kind, [0, 0.0, 0.0])
            s[0] += 1
            s[1] += ms
            s[2] = max(s[2], ms)

    def mark(self, kind: str, start: float | None = None, **fields: Any) -> None:
        """One event on the timeline, at ``time.monotonic()`` now; ``start`` (the same clock) makes it a span."""
        if self._timeline is None or self._events_left <= 0:
            return
        self._events_left -= 1  # a race between threads here may lose a count, never an event
        if self._events_left <= 0:
            kind, start, fields = "timeline_full", None, {}
        self._events.append((time.monotonic(), kind, start, fields))
        if len(self._events) >= FLUSH_EVENTS:
            self._write_timeline()

    def _write_timeline(self) -> None:
        if self._timeline is None:
            return
        with self._lock:
            n = len(self._events)
            events = self._events[:n]
            del self._events[:n]  # what other threads append meanwhile stays for the next write
            lines = []
            for now, kind, start, fields in events:
                event = {"t": round(now, 6), "k": kind, **fields}
                if start is not None:
                    event["ms"] = round((now - start) * 1e3, 3)
                lines.append(json.dumps(event))
            with self._timeline.open("a") as f:
                f.write("".join(line + "\n" for line in lines))

    def gpu(self, kind: str, start: Any, end: Any) -> None:
        """Times two CUDA events apart once the GPU passed them (never waits for them)."""
        if self.path is not None:
            self.pending.append((kind, start, end))

    def maybe_write(self, force: bool = False) -> None:
        if self.path is None or (not force and time.monotonic() - self._written < 0.5):
            return
        self._written = time.monotonic()
        left = []
        for kind, start, end in self.pending:
            if end.query():
                self.add(kind, start.elapsed_time(end))
            else:
                left.append((kind, start, end))
        self.pending = left
        if force:
            self._write_timeline()
        with self._lock:
            data = {k: {"n": int(n), "total_ms": round(t, 3), "max_ms": round(m, 3)} for k, (n, t, m) in
                    self._sums.items()}  # fmt: skip
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)
