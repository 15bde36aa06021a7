"""One side's session with the pool, kept usable across a pool that goes down or restarts.

An engine must serve whether or not the pool is there: a call that fails is logged once, answered as "nothing
in the pool", and the session is opened anew at most every ``retry_s``. Requests then compute their KV as if
there were no connector, which is always correct.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvpool.client import PoolClient
from kvpool.errors import HandoffNotFound, HandoffRefused, InvalidRequest, LimitExceeded, NotOwner, PoolExhausted
from kvpool.layout import KVLayout

log = logging.getLogger("vllm.kvpool")
T = TypeVar("T")

#: the pool answered and said no: the session is fine, only this call has nothing to give. Anything else (the
#: pool unreachable, restarted, the session expired) drops the session, whose refs the pool then releases.
REFUSALS = (HandoffNotFound, HandoffRefused, InvalidRequest, LimitExceeded, NotOwner, PoolExhausted)


class PoolLink:
    def __init__(
        self,
        url: str | None,
        name: str,
        token: str | None = None,
        layout: KVLayout | None = None,
        retry_s: float = 5.0,
        connect: Callable[..., PoolClient] = PoolClient,
    ) -> None:
        self.url, self.name, self.token, self.layout, self.retry_s = url, name, token, layout, retry_s
        #: holds the name for this engine alone: the pool's word of who parked a handoff is then worth checking
        self.name_key = secrets.token_urlsafe(24)
        self._connect = connect
        self.client: PoolClient | None = None
        self._next_try = 0.0
        self._warned = False
        self._lock = threading.RLock()  # the engine's thread and the saver's share the session

    def open(self) -> PoolClient:
        """The session, opened now; errors propagate (for start-up, where a missing pool should be said)."""
        if self.client is None:
            # no polling for answers whatever KVPOOL_REPLY_SPIN_US says: the engine's threads need the GIL meanwhile
            self.client = self._connect(self.url, name=self.name, role="other", token=self.token, layout=self.layout,
                                        reply_spin_s=0.0, name_key=self.name_key)  # fmt: skip
        return self.client

    def call(self, what: str, fn: Callable[[PoolClient], T], default: T) -> T:
        """``fn(client)``, or ``default`` when the pool cannot answer (logged, and the session dropped)."""
        with self._lock:
            return self._call(what, fn, default)

    def _call(self, what: str, fn: Callable[[PoolClient], T], default: T) -> T:
        now = time.monotonic()
        if self.client is None:
            if now < self._next_try:
                return default
            try:
                self.open()
            except Exception as exc:
                self._fail(what, exc, now)
                return default
        assert self.client is not None
        try:
            result = fn(self.client)
        except REFUSALS as exc:
            log.debug("kvpool: %s refused: %s", what, exc)
            return default
        except Exception as exc:
            self._fail(what, exc, now)
            return default
        if self._warned:
            log.warning("kvpool: the pool answers again (%s)", self.url or "default socket")
            self._warned = False
        return result

    def _fail(self, what: str, exc: Exception, now: float) -> None:
        if not self._warned:
            log.warning("kvpool: %s failed (%s: %s); serving without the pool until it answers", what,
                        type(exc).__name__, exc)  # fmt: skip
            self._warned = True
        self.close()
        self._next_try = now + self.retry_s

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
