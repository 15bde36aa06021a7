"""A pool served in this process: its control plane, HTTP app and fast channel on an event loop of their own.

A test of a call needs the pool's answers, not its process: starting ``kvpool serve`` costs a Python start-up and its
imports, seconds on a loaded machine; this costs milliseconds. Clients reach it at :attr:`LocalPool.url`
(``local://NAME``) as they reach any pool: HTTP through :class:`kvpool.transport.LocalTransport`, the fast channel
and inboxes through their own Unix sockets. What only a process shows (a crash, a restart, a signal, the HTTP
listeners' guards) is tested against ``kvpool serve`` itself (:mod:`kvpool.server.launch`).
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kvpool.client import http_client
from kvpool.errors import KvpoolError
from kvpool.server.config import PoolSettings, settings_from_args
from kvpool.server.main import SHUTDOWN_GRACE_S, fast_channel, serve_parser
from kvpool.server.plane import ControlPlane
from kvpool.server.transports.app import create_app
from kvpool.transport import LocalTransport

T = TypeVar("T")
_names = itertools.count()


class LocalPool:
    """One pool in this process, from start to :meth:`stop`; what a test reads of a pool process it reads here too
    (``url``, ``stats()``, ``http()``), and ``plane`` besides."""

    def __init__(self, settings: PoolSettings, workdir: Path | None = None) -> None:
        self.settings = settings
        self.workdir = workdir
        self.plane = ControlPlane(settings)
        self.app = create_app(self.plane)
        if settings.fast_socket is not None:
            fast = fast_channel(self.plane, settings.max_fast_connections)
            self.app.state.on_start.append(fast.start)
            self.app.state.on_stop.append(fast.stop)
        self.plane.start()
        if self.plane.startup_error:
            self.plane.close()
            raise KvpoolError(f"the pool could not start: {self.plane.startup_error}")
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvpool-local", daemon=True)
        self._thread.start()
        self._lifespan = self.app.router.lifespan_context(self.app)
        self._run(self._lifespan.__aenter__())
        self.transport = LocalTransport(f"pool-{next(_names)}", self.app, self.loop)
        LocalTransport.served[self.transport.name] = self.transport

    @classmethod
    def from_flags(cls, *flags: str, workdir: Path | None = None) -> LocalPool:
        """A pool set as ``kvpool serve FLAGS`` would be (``KVPOOL_*`` variables of this process included)."""
        return cls(settings_from_args(serve_parser().parse_args(list(flags))), workdir)

    @property
    def url(self) -> str:
        return self.transport.url

    @property
    def tcp_url(self) -> str:
        """The same pool: here HTTP has one way in."""
        return self.url

    @property
    def socket(self) -> Path | None:
        return self.settings.socket

    def http(self, token: str | None = None, timeout_s: float = 30.0) -> httpx.Client:
        return http_client(self.url, token, timeout_s)

    def stats(self, token: str | None = None) -> dict[str, Any]:
        with self.http(token) as h:
            stats: dict[str, Any] = h.get("/stats").json()
            return stats

    def output(self) -> str:
        """A process's log; this pool logs to the test's own loggers."""
        return ""

    def stop(self) -> int:
        """Answer waiting claims, stop serving and release the arena, as a pool process does on SIGTERM."""
        if LocalTransport.served.pop(self.transport.name, None) is None:
            return 0
        self._run(self._stop_waiting())
        self.transport.drain(SHUTDOWN_GRACE_S)
        self._run(self._lifespan.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return 0

    async def _stop_waiting(self) -> None:
        self.plane.stop_waiting()

    def _run(self, step: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(step, self.loop).result()

    def __enter__(self) -> LocalPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
