"""Claims that wait: a consumer's ``/claim`` for a handoff not parked yet, woken as soon as one is.

Kept apart from the books: a waiting claim is an asyncio future of the control plane's event loop, while the books
(:mod:`kvpool.server.books.pool`) only ever answer at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from collections.abc import Callable

from kvpool.errors import HandoffNotFound, KvpoolError, PoolUnavailable
from kvpool.protocol import ClaimRequest
from kvpool.server.books.pool import Pool
from kvpool.server.books.records import Handoff

STOPPING = "the pool is shutting down: claim again once it is back (a restarted pool has a new epoch)"

#: makes, once a claim has to wait, an awaitable that raises when the claimer goes away (and returns if it is
#: still there); the transport owns it, and the claim neither cancels nor awaits it again
Watch = Callable[[], "asyncio.Future[object]"]


class ClaimerGone(KvpoolError):
    """The claimer went away while its claim waited: nothing was claimed for it (nobody reads this answer)."""

    status = 499


class ClaimWaits:
    """The claims waiting, by the request id they wait for (None: any handoff for their session)."""

    def __init__(self) -> None:
        self._stopping = False
        self._waiters: defaultdict[str | None, set[asyncio.Future[None]]] = defaultdict(set)
        self._waiting: Counter[str] = Counter()  # by session

    @property
    def waiting(self) -> int:
        return self._waiting.total()

    def stop(self) -> None:
        """Answer every waiting claim now with 503, and let no new claim wait.

        A claim may wait up to an hour; a stopping pool should neither wait that long for it nor cut it off with
        no answer. The claimer gets PoolUnavailable and claims again from the restarted pool.
        """
        self._stopping = True
        for futures in self._waiters.values():
            for fut in futures:
                if not fut.done():
                    fut.set_exception(PoolUnavailable(STOPPING))

    def cancel(self) -> None:
        for futures in self._waiters.values():
            for fut in futures:
                if not fut.done():
                    fut.cancel()

    def wake(self, request_id: str) -> None:
        for key in (request_id, None):
            for fut in self._waiters.get(key, ()):
                if not fut.done():
                    fut.set_result(None)

    async def claim(self, pool: Pool, req: ClaimRequest, watch: Watch | None = None) -> Handoff:
        """The claim, waiting only as long as its claimer is there to take the answer.

        A claim that outlives its caller (an HTTP client that timed out, a fast-channel connection that closed)
        would take the next handoff into the session with nobody to learn the ids, and the blocks would stay held
        until the session ends. So a waiting claim stops when ``watch`` says the caller left, and a handoff it took
        in that same moment is parked again.
        """
        try:
            return pool.claim(req.session_id, req.request_id)
        except HandoffNotFound:
            if req.timeout_s <= 0 or watch is None:
                return await self._wait(pool, req)
        gone = watch()
        waiting = asyncio.ensure_future(self._wait(pool, req))
        try:
            await asyncio.wait((waiting, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            waiting.cancel()
            raise
        if not gone.done() or gone.exception() is None:
            return await waiting
        if not waiting.done():
            waiting.cancel()
            with contextlib.suppress(asyncio.CancelledError, KvpoolError):
                await waiting
        elif waiting.exception() is None:
            pool.unclaim(req.session_id, waiting.result())
        raise ClaimerGone("the claimer went away while its claim waited")

    async def _wait(self, pool: Pool, req: ClaimRequest) -> Handoff:
        """Claim, waiting up to ``timeout_s`` for a matching handoff; a session may have only so many waiting."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + req.timeout_s
        sid = req.session_id
        counted = False
        try:
            while True:
                try:
                    return pool.claim(sid, req.request_id)
                except HandoffNotFound:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise HandoffNotFound(
                            f"no handoff {'parked' if req.request_id is None else repr(req.request_id)} "
                            f"within {req.timeout_s}s"
                        ) from None
                if self._stopping:
                    raise PoolUnavailable(STOPPING)
                if not counted:
                    if self._waiting[sid] >= pool.limits.max_claims_per_session:
                        raise pool.exceeded(
                            "max_claims_per_session", f"this session has {self._waiting[sid]} claims waiting"
                        )
                    self._waiting[sid] += 1
                    counted = True
                fut: asyncio.Future[None] = loop.create_future()
                waiters = self._waiters[req.request_id]
                waiters.add(fut)
                try:
                    await asyncio.wait_for(fut, remaining)
                except TimeoutError:
                    pass
                finally:
                    waiters.discard(fut)
                    if not waiters:
                        self._waiters.pop(req.request_id, None)
        finally:
            if counted:
                self._waiting[sid] -= 1
                if not self._waiting[sid]:
                    del self._waiting[sid]
