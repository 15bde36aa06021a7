"""``PoolClient``: what a worker process uses to talk to the pool and map its arena.

One client holds one session (:mod:`kvpool.session`), kept alive in the background and released on exit, and
reaches the pool over HTTP or, for the hot calls (alloc, free, commit, lookup, handoff, claim), the fast channel
(:mod:`kvpool.transport`). The arena is mapped once per process, whatever the number of clients (:mod:`kvpool.attach`).

Block ids are fenced (each carries its block's generation, see :mod:`kvpool.ids`) and go over the fast channel
packed as int64: hand them over as an ``array('q')``, an int64 numpy array or CPU tensor, and no id is converted
on the way. :class:`kvpool.devices.DeviceSession` gives workers plain arena indices instead, and fences them again
on the way back. A client opened with ``inbox=True`` also receives the ids of handoffs addressed to it
(``handoff(..., to=name)``) in its inbox, sent and sealed by the pool as soon as it parked them
(:mod:`kvpool.handoffs`).
"""

from __future__ import annotations

import os
import sys
import time
from array import array
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from kvpool.address import default_url
from kvpool.arena import Arena, forget_mappings
from kvpool.attach import ArenaMapper
from kvpool.errors import raise_for
from kvpool.handoffs import Claim, DirectHandoffs, Handoff, granted
from kvpool.layout import KVLayout
from kvpool.protocol import (
    ArenaDescriptor,
    CommitResponse,
    HandoffResponse,
    Health,
    LookupResponse,
    Role,
    SessionSummary,
)
from kvpool.routes import ALLOC, CLAIM, COMMIT, FREE, HANDOFF, HEARTBEAT, LOOKUP, LOOKUPS, SESSIONS, STATS, Route
from kvpool.session import Session
from kvpool.tokens import pack_tokens
from kvpool.transport import Transport, http_client, reply_spin

__all__ = ["Claim", "Handoff", "PoolClient", "http_client", "raise_for"]


def _as_list(ids: Sequence[int] | Any) -> list[int]:
    """A list as it is (the request model validates it into its own), anything else as a new list."""
    if type(ids) is list:
        return ids
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def _tokens(token_ids: Sequence[int] | Any) -> dict[str, Any]:
    """A prompt's tokens as a request carries them: packed (see :mod:`kvpool.tokens`), or as a list where one is no
    uint32, for the pool to say which."""
    tokens = _as_list(token_ids)
    packed = pack_tokens(tokens)
    return {"tokens": packed} if packed is not None else {"token_ids": tokens}


def settle_device(devices: Sequence[Any] = ()) -> None:
    """Wait for the kernels in flight on the current CUDA device and on ``devices`` (the arenas' devices), where
    this process initialised CUDA: a shutdown or a crash that closes the session must not leave a kernel writing
    into blocks the pool is about to give to another engine. torch is not imported where it was not already."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    torch.cuda.synchronize()
    for device in {d for d in devices if getattr(d, "type", None) == "cuda"}:
        torch.cuda.synchronize(device)


class PoolClient:
    """A session with the pool.

    Args:
        url: ``unix:///path/kvpool.sock`` or ``http://127.0.0.1:8470``; default ``$KVPOOL_URL``, else the
            pool's default socket.
        name, role: how the session shows up in the pool's stats and logs. The name is also what producers address
            handoffs to (``handoff(..., to=name)``).
        name_key: a secret (16 to 256 characters) that holds ``name`` for this worker: once a session opened the name
            with a key, the pool opens it again only for the same key, also after that session ended, so a restarted
            worker takes its name back and no other session can take it meanwhile (default ``$KVPOOL_NAME_KEY``).
        token: the pool's bearer token, if it has one (default ``$KVPOOL_TOKEN``).
        layout: your model's KV layout; the pool refuses a session whose layout differs from the arena's.
        fast: use the fast channel when the pool serves one and it is reachable from here.
        inbox: receive the ids of handoffs addressed to this session (``handoff(..., to=name)``) in an inbox, as
            soon as the pool parked them (needs the fast channel; give the session a name no other live session has).
        spin_s: how long ``claim`` watches the inbox before it waits in the pool instead. Spinning holds a core
            but saves a wake-up (tens of microseconds); a handoff that comes later arrives through the pool.
        reply_spin_s: how long a call over the fast channel polls for the pool's answer before it sleeps (default
            ``KVPOOL_REPLY_SPIN_US``, else 0). An answer that comes meanwhile spares this thread a wake-up, about half
            a round trip on a VM; the polling holds a core and the GIL, so leave it 0 where other threads of the
            process must run meanwhile (an inference engine's scheduler).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        name: str = "client",
        role: Role = "other",
        token: str | None = None,
        layout: KVLayout | None = None,
        fast: bool = True,
        timeout_s: float = 30.0,
        heartbeat: bool = True,
        inbox: bool = False,
        spin_s: float = 0.001,
        reply_spin_s: float | None = None,
        name_key: str | None = None,
    ) -> None:
        self.url = url or default_url()
        self.name = name
        self.role: Role = role
        self.token = token if token is not None else os.environ.get("KVPOOL_TOKEN")
        self.layout = layout
        self.timeout_s = timeout_s
        self._use_fast = fast
        self._want_inbox = inbox
        self._arenas: dict[int | None, Arena] = {}
        self._closed = False
        self.transport = Transport(self.url, self.token, timeout_s, reply_spin(reply_spin_s))
        key = name_key if name_key is not None else os.environ.get("KVPOOL_NAME_KEY") or None
        self.session = Session(self.transport, name, role, layout, on_restart=self._arenas.clear, name_key=key)
        self.mapper = ArenaMapper(self.transport, self.session, self._arenas)
        self.direct = DirectHandoffs(self.transport, self.session, spin_s)
        self._open_session()
        if heartbeat:
            self.session.start_heartbeat()

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def epoch(self) -> str:
        return self.session.epoch

    @property
    def lease_ttl_s(self) -> float:
        return self.session.lease_ttl_s

    # -- session ----------------------------------------------------------------------------------------

    def _open_session(self) -> None:
        info = self.session.open(inbox=self._want_inbox and self._use_fast)
        path = info.fast_socket
        fast = self.transport.use_fast(path if self._use_fast else None)
        self.mapper.fd_path = path if info.arena_fd and path and os.path.exists(path) else None
        if info.inbox is not None and fast is not None:
            self.direct.open_inbox(info.inbox, bytes.fromhex(info.inbox_key or ""), self.transport.fast_mode())

    def reconnect(self) -> None:
        """Open a new session (after the pool restarted or the lease ran out); map the arena anew on demand.

        If the pool restarted, the old arena's views are invalidated here too, even when no call noticed the
        restart first: they point at memory the new pool does not manage.
        """
        with self.session.lock:
            old_epoch = self.epoch
            self.transport.reset()
            self.direct.close_inbox()
            self._arenas.clear()
            self._open_session()
            if self.epoch != old_epoch:
                forget_mappings(old_epoch)

    def close(self) -> None:
        """End the session: once kernels this process launched have finished (see :func:`settle_device`), since
        the pool gives its blocks to others as soon as the session is closed."""
        if self._closed:
            return
        self._closed = True
        settle_device([arena.device for arena in self._arenas.values()])
        self.session.close()
        self.direct.close()
        self.transport.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- arena ------------------------------------------------------------------------------------------

    def descriptor(self) -> ArenaDescriptor:
        return self.mapper.descriptor()

    def arena(self, layout: KVLayout | None = None, device: int | None = None) -> Arena:
        """The arena mapped into this process (once per process), checked against your model's layout.

        ``device`` picks one arena of a pool that serves several GPUs (as the pool names the device).
        """
        return self.mapper.arena(layout or self.layout, layout, device)

    # -- blocks -----------------------------------------------------------------------------------------

    def alloc(self, num_blocks: int, device: int | None = None) -> list[int]:
        req = ALLOC.build(session_id=self.session_id, num_blocks=num_blocks, device=device)
        return self._call(ALLOC, req)[0].block_ids

    def free(self, block_ids: Sequence[int]) -> int:
        req, ids = self._with_ids(FREE, block_ids, session_id=self.session_id)
        return self._call(FREE, req, ids=ids)[0].freed

    def commit(
        self, block_ids: Sequence[int], token_ids: Sequence[int], salt: str | None = None, start: int = 0,
        release: bool = False,
    ) -> CommitResponse:  # fmt: skip
        """Make the full blocks of ``token_ids`` findable by other sessions (call after your KV writes finished);
        with a ``salt`` (a tenant, a LoRA adapter), only by lookups with the same salt. ``start``: the pool holds the
        first blocks already (you looked them up) and ``block_ids`` hold block ``start`` on; ``release``: drop your
        refs on ``block_ids`` too (commit and free in one call)."""
        fields = {"session_id": self.session_id, **_tokens(token_ids), "salt": salt, "start": start, "release": release}
        req, ids = self._with_ids(COMMIT, block_ids, **fields)
        return self._call(COMMIT, req, ids=ids)[0]

    def commit_many(
        self, commits: Sequence[tuple[Sequence[int], Sequence[int], int]], release: bool = False,
        salts: Sequence[str | None] | None = None,
    ) -> list[CommitResponse | None]:  # fmt: skip
        """``commit(block_ids, token_ids, salt, start=start, release=release)`` of each ``(block_ids, token_ids,
        start)`` with the salt at its place in ``salts`` (none: no salt), in order: over the fast channel all in one
        write (a step's saves in one round trip). ``None`` for each the pool refused, whose blocks stay yours; an
        error about the session itself raises."""
        salts = salts or [None] * len(commits)
        reqs = [COMMIT.build(session_id=self.session_id, block_ids=_as_list(ids), **_tokens(tokens), start=start,
                             release=release, salt=salt)
                for (ids, tokens, start), salt in zip(commits, salts, strict=True)]  # fmt: skip
        return self._many(COMMIT, reqs)

    def lookup(self, token_ids: Sequence[int], device: int | None = None, salt: str | None = None) -> LookupResponse:
        """The longest cached prefix of ``token_ids`` committed with ``salt``; you hold a ref on each returned block
        until you free it."""
        fields = {**_tokens(token_ids), "device": device, "salt": salt}
        return self._call(LOOKUP, LOOKUP.build(session_id=self.session_id, **fields))[0]

    def lookup_many(
        self, prompts: Sequence[Sequence[int]], device: int | None = None, salt: str | None = None,
        salts: Sequence[str | None] | None = None,
    ) -> list[LookupResponse]:  # fmt: skip
        """``lookup`` of each prompt, in one round trip (a scheduler step's arrivals); with ``salt``, or each with
        the salt at its place in ``salts``."""
        each = salts if salts is not None else [salt] * len(prompts)
        items = [{**_tokens(t), "salt": s} for t, s in zip(prompts, each, strict=True)]
        req = LOOKUPS.build(session_id=self.session_id, lookups=items, device=device)
        return self._call(LOOKUPS, req)[0].hits

    def handoff(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        meta: dict[str, Any] | None = None,
        ttl_s: float | None = None,
        to: str | None = None,
        keep: bool = False,
        sealed: bool = False,
    ) -> HandoffResponse:
        """Park the blocks under ``request_id`` for a consumer; your refs on them move to the handoff (``keep``: the
        handoff takes refs of its own and you keep yours, for committed blocks you still use). ``sealed``: only a
        claim that names ``request_id`` takes it (park under an unguessable id and tell it to the consumer alone).

        ``to`` names the session that will claim it (and no other may). If that session has an inbox, its ids go
        there directly as soon as the pool has the handoff, and its claim returns without waiting for the pool.
        """
        return self._handoff(Handoff(request_id, block_ids, num_tokens, meta, ttl_s, to, keep, sealed))

    def _handoff(self, h: Handoff) -> HandoffResponse:
        """:meth:`handoff`, as a subclass that carries some handoffs another way takes it up."""
        if h.to is not None and not h.keep and not h.sealed:
            sent = self.direct.send(h.request_id, h.block_ids, h.num_tokens, h.meta or {}, h.ttl_s, h.to)
            if sent is not None:
                return sent
        fields = {"request_id": h.request_id, "num_tokens": h.num_tokens, "meta": h.meta or {}, "ttl_s": h.ttl_s,
                  "to": h.to}  # fmt: skip
        if h.keep:
            fields["keep"] = True
        if h.sealed:
            fields["sealed"] = True
        req, ids = self._with_ids(HANDOFF, h.block_ids, session_id=self.session_id, **fields)
        return self._call(HANDOFF, req, ids=ids)[0]

    def handoff_many(
        self,
        handoffs: Sequence[tuple[str, Sequence[int], int, dict[str, Any] | None]],
        ttl_s: float | None = None,
        keep: bool = False,
        sealed: bool = False,
    ) -> list[HandoffResponse | None]:
        """``handoff(request_id, block_ids, num_tokens, meta, ttl_s, keep=keep, sealed=sealed)`` of each, parked in
        the pool, in order: over the fast channel all in one write. ``None`` for each the pool refused, whose blocks
        stay yours; an error about the session itself raises."""
        reqs = [HANDOFF.build(session_id=self.session_id, request_id=r, block_ids=_as_list(ids), num_tokens=n,
                              meta=meta or {}, ttl_s=ttl_s, keep=keep, sealed=sealed)
                for r, ids, n, meta in handoffs]  # fmt: skip
        return self._many(HANDOFF, reqs)

    def claim(self, request_id: str | None = None, timeout_s: float = 30.0) -> Claim:
        """Take a parked handoff (the oldest you may claim if ``request_id`` is None), waiting up to ``timeout_s``.

        With an inbox, a handoff delivered to it returns at once, while the pool's answer to the claim is still
        on its way: your next call to the pool (or :meth:`confirm`) raises if the pool refused it. Claiming a
        known ``request_id`` puts the claim in at the pool first and then watches the inbox, so whichever comes
        first, the ids in the inbox or the pool's answer, ends the wait.
        """
        if self.direct.inbox is None:
            return self._claim_from_pool(request_id, timeout_s)
        if request_id is not None:
            return self.direct.claim_expected(request_id, timeout_s)
        return self.direct.claim_any(timeout_s, self._claim_from_pool)

    def _claim_from_pool(self, request_id: str | None, timeout_s: float) -> Claim:
        req = CLAIM.build(session_id=self.session_id, request_id=request_id, timeout_s=timeout_s)
        return self.direct.claimed_in_pool(*self._call(CLAIM, req, wait_s=timeout_s))

    def claim_many(self, request_ids: Sequence[str], timeout_s: float = 0.0) -> list[Claim | None]:
        """Claim several known handoffs (a decode engine's arrivals), in order; ``None`` for each the pool refused
        (not parked within ``timeout_s``, not yours to claim). Over the fast channel they go in one write: a burst
        of claims costs about one round trip, and a claim that waits holds back the answers after it. Errors about
        the session itself (unknown, the pool restarted or unreachable) raise."""
        if self.direct.inbox is not None:
            return self.direct.one_by_one(request_ids, lambda r: self.claim(r, timeout_s))
        reqs = [CLAIM.build(session_id=self.session_id, request_id=r, timeout_s=timeout_s) for r in request_ids]
        return self.direct.claim_many_in_pool(reqs, timeout_s)

    def confirm(self) -> None:
        """Wait for the pool's answers to this thread's direct claims; raise if it refused one (its blocks are
        then not yours). Any later call on this thread does the same first."""
        self.direct.confirm()

    def sessions(self, name: str | None = None) -> list[SessionSummary]:
        """The pool's live sessions (by name, role and inbox), or those called ``name``."""
        listing = self.transport.request("GET", SESSIONS.url(), params={"name": name} if name is not None else None)
        assert SESSIONS.response is not None
        sessions: list[SessionSummary] = SESSIONS.response.model_validate(listing).sessions
        return sessions

    def move(self, block_ids: Sequence[int], device: int) -> list[int]:
        """Copy blocks you hold into new blocks on ``device``'s arena and drop your refs on the originals.

        The copy runs in this process, on its current streams (:func:`kvpool.transfer.copy_blocks`), so kernels
        launched next on ``device`` see the KV; the originals are freed only once the copy has read them.
        """
        from kvpool.transfer import copy_blocks

        if not block_ids:
            return []
        src = self.arena(device=self.arena().descriptor.device_of(block_ids[0]))
        dst = self.arena(device=device)
        new = self.alloc(len(block_ids), device=device)
        try:
            done = copy_blocks(src, block_ids, dst, new)
            if done is not None:
                done.synchronize()
        except BaseException:
            self.free(new)
            raise
        self.free(block_ids)
        return new

    def heartbeat(self) -> None:
        req = HEARTBEAT.build(session_id=self.session_id)
        sent = time.monotonic()
        self._call(HEARTBEAT, req)
        self.session.renewed(sent)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.transport.request(STATS.method, STATS.url())
        return stats

    def health(self) -> Health:
        return self.session.health()

    # -- the wire ---------------------------------------------------------------------------------------

    def _with_ids(self, route: Route, block_ids: Sequence[int], **fields: Any) -> tuple[Any, memoryview | None]:
        """The request, and its ids packed where the transport attaches them (then the request's ``block_ids`` is
        empty)."""
        ids = self.transport.attach(route, block_ids)
        return route.build(block_ids=[] if ids is not None else _as_list(block_ids), **fields), ids

    def _many(self, route: Route, reqs: list[BaseModel]) -> list[Any]:
        """Calls of one route sent in one write, answered in order (see :func:`kvpool.handoffs.granted`)."""
        answers = self.direct.guard(lambda: self.transport.call_many(route, reqs))
        return granted(answers, lambda answer: answer[0])

    def _call(
        self, route: Route, req: BaseModel, wait_s: float = 0.0, ids: memoryview | None = None
    ) -> tuple[Any, array | None]:
        """One call of this session; the refusal of an earlier pipelined claim is raised here if there was one."""
        return self.direct.guard(lambda: self.transport.call(route, req, wait_s, ids))
