"""A client's session with the pool: opened, kept alive by a background heartbeat, lost, and opened again.

A session is lost when its lease ran out or the pool restarted. Every call goes through :meth:`Session.guard`,
so a lost session fails the next call with the reason, and a restart (a new epoch) retires the old arena's views
before anything can read them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import httpx
from pydantic import ValidationError

from kvpool.arena import forget_mappings
from kvpool.errors import (
    InvalidRequest,
    KvpoolError,
    LeaseLapsed,
    PoolRestarted,
    PoolTimeout,
    PoolUnavailable,
    UnknownSession,
)
from kvpool.layout import KVLayout
from kvpool.protocol import Health, Role, SessionCreate, SessionInfo
from kvpool.routes import CLOSE_SESSION, HEALTH, HEARTBEAT, OPEN_SESSION
from kvpool.transport import Transport

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how much earlier than the pool a client gives up its lease: at least this, or a tenth of the lease
LEASE_MARGIN_S = 0.5


def lease_margin(lease_ttl_s: float) -> float:
    return max(LEASE_MARGIN_S, lease_ttl_s / 10)


class Session:
    """The session's id, epoch and lease; ``on_restart`` drops what the client kept of the old pool."""

    def __init__(
        self,
        transport: Transport,
        name: str,
        role: Role,
        layout: KVLayout | None,
        on_restart: Callable[[], None],
        name_key: str | None = None,
    ) -> None:
        self.transport = transport
        self.name = name
        self.name_key = name_key
        self.role: Role = role
        self.layout = layout
        self.on_restart = on_restart
        self.session_id = ""
        self.epoch = ""
        self.lease_ttl_s = 0.0
        self.lost: KvpoolError | None = None
        #: until when (time.monotonic) this process knows its lease runs: the send of the last open or heartbeat
        #: the pool acknowledged, plus the lease, less a margin (see :meth:`lapsed`)
        self.proven_until = -math.inf
        self._proven_at = -math.inf  # the send behind proven_until
        #: why the last heartbeat did not reach the pool (None once one does): a pool that stopped answering
        self.unreachable: Exception | None = None
        self.lock = threading.Lock()  # orders a reopen against the heartbeat marking a session lost
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.on_beat: Callable[[], None] | None = None  # after each heartbeat the pool answered

    def open(self, inbox: bool) -> SessionInfo:
        try:
            req = SessionCreate(name=self.name, role=self.role, layout=self.layout, inbox=inbox, name_key=self.name_key)
        except ValidationError as exc:
            raise InvalidRequest(f"cannot open a session: {exc}") from None
        sent = time.monotonic()
        info: SessionInfo = self.transport.fetch(OPEN_SESSION, req)
        self.session_id = info.session_id
        self.epoch = info.epoch
        self.lease_ttl_s = info.lease_ttl_s
        self.lost = None
        self._proven_at = -math.inf
        self.renewed(sent)
        return info

    def renewed(self, sent: float) -> None:
        """The pool acknowledged a renewal of the lease sent at ``sent`` (time.monotonic): the pool extended the
        lease at some moment after that, so the lease runs at least until ``sent`` plus its length."""
        if sent > self._proven_at:
            self._proven_at = sent
            self.proven_until = sent + self.lease_ttl_s - lease_margin(self.lease_ttl_s)

    def lapsed(self) -> KvpoolError | None:
        """Why this process may no longer write into its blocks, or None while its lease is proven.

        Cheap (a clock read and a comparison): an engine calls it every step and again right before it launches
        kernels that write KV. The pool's own clock decides when a lease runs out, and a process that was stalled
        (stopped, swapped out, starved of CPU) learns nothing from its heartbeat thread until that thread runs
        again, so only a deadline from the last renewal the pool acknowledged is proof."""
        if self.lost is not None:
            return self.lost
        now = time.monotonic()
        if now <= self.proven_until:
            return None
        since = now - self._proven_at
        return LeaseLapsed(
            f"kvpool session {self.session_id or '(not open)'}: no lease renewal acknowledged for {since:.1f} s "
            f"(lease {self.lease_ttl_s:g} s, less a margin of {lease_margin(self.lease_ttl_s):g} s): the pool may "
            "have ended the session and given its blocks to another engine. Write nothing more into the arena: stop "
            "scheduling, and go on only once a heartbeat is acknowledged again (or reconnect() after it is lost)"
        )

    def start_heartbeat(self) -> None:
        self._beat = threading.Thread(target=self._heartbeat_loop, name=f"kvpool-heartbeat-{self.name}", daemon=True)
        self._beat.start()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.lease_ttl_s / 3):
            if self.lost is not None:  # already known lost: wait for a reopen instead of warning every beat
                continue
            session_id = self.session_id
            try:
                sent = time.monotonic()
                self.transport.fetch(HEARTBEAT, session_id=session_id)
                with self.lock:  # not for a session a reopen replaced meanwhile
                    if self.session_id == session_id:
                        self.renewed(sent)
                self.unreachable = None
                if self.on_beat is not None:
                    self.on_beat()
            except UnknownSession as exc:
                # Under the lock a reopen takes: a beat for the old session that comes back after the new one
                # opened must not mark the new one lost.
                with self.lock:
                    if self.session_id != session_id:
                        continue
                    try:
                        self.check_epoch()
                        self.lost = exc
                    except PoolRestarted as restarted:
                        self.lost = restarted
                log.warning("kvpool session lost: %s", self.lost)
            except (KvpoolError, httpx.HTTPError) as exc:
                self.unreachable = exc
                log.warning("kvpool heartbeat failed: %s", exc)

    def guard(self, fn: Callable[[], T]) -> T:
        """Run one call of this session; after a refusal that may mean the pool restarted, find out whether it did."""
        if self.lost is not None:
            raise self.lost
        try:
            return fn()
        except PoolTimeout:
            raise  # a pool that does not answer would leave the question of its epoch waiting as long again
        except (UnknownSession, PoolUnavailable):
            self.check_epoch()
            raise

    def health(self) -> Health:
        return Health.model_validate_json(self.transport.http.get(HEALTH.url()).content)

    def check_epoch(self) -> None:
        """If the pool restarted, say so and retire the old arena's views."""
        try:
            now = self.health().epoch
        except (httpx.HTTPError, ValidationError, KvpoolError):
            return
        if now != self.epoch:
            self.restarted(now)

    def restarted(self, now: str) -> NoReturn:
        """Retire this epoch's arena views and fail every later call with PoolRestarted until a reopen."""
        forget_mappings(self.epoch)
        self.on_restart()
        self.lost = PoolRestarted(
            f"the pool restarted (epoch {self.epoch} -> {now}): the old arena and its blocks are gone; "
            "call reconnect() and map the arena again"
        )
        raise self.lost

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=2)
        with contextlib.suppress(httpx.HTTPError):
            self.transport.http.delete(CLOSE_SESSION.url(self.session_id))
