"""Pool calls of one kind batched on a thread of their own: what keeps an engine's burst to one round trip."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Batcher(Generic[T, R]):
    """Calls of one kind that come while one is under way go together in the next, on a thread of their own: a
    burst of 32 arrivals costs one round trip and one wait for the GIL (an engine's threads hold it while they
    compute, so each return from a socket wait can cost a switch interval), where one call each cost 32."""

    def __init__(self, name: str, run: Callable[[list[T]], list[R]], failed: Callable[[Exception], R]) -> None:
        self._run = run
        self._failed = failed
        self._pending: list[tuple[T, Future[R]]] = []
        self._lock = threading.Lock()
        self._lane = ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, item: T) -> Future[R]:
        future: Future[R] = Future()
        with self._lock:
            self._pending.append((item, future))
            first = len(self._pending) == 1
        if first:  # else the batch it joined has not been sent yet
            self._lane.submit(self._send)
        return future

    def _send(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        if not batch:
            return
        try:
            results = self._run([item for item, _ in batch])
        except Exception as exc:  # every caller gets an answer, whatever happened to the call
            results = [self._failed(exc)] * len(batch)
        for (_, future), result in zip(batch, results, strict=True):
            future.set_result(result)

    def drain(self) -> None:
        self._lane.submit(lambda: None).result()

    def close(self) -> None:
        self._lane.shutdown(wait=True)
