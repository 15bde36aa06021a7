"""The control plane: the handlers that both the HTTP API and the fast channel call.

It owns the arena's allocation, the pool's books and the claims that wait (:mod:`kvpool.server.books.claims`). Handlers
take and return the protocol models; the transports only parse, authenticate and map :class:`KvpoolError` to a
status.
"""

from __future__ import annotations

import logging
import os
import secrets
from array import array
from pathlib import Path
from typing import Any

from kvpool.errors import InvalidRequest, PoolUnavailable
from kvpool.ids import pack_ids
from kvpool.inbox import SEAL_BYTES, Outbox, encode_delivery, seal_delivery
from kvpool.protocol import (
    AcceptResponse,
    AllocRequest,
    AllocResponse,
    ArenaDescriptor,
    ArenaFdRequest,
    ArenaFdResponse,
    ClaimRequest,
    ClaimResponse,
    CommitRequest,
    CommitResponse,
    FreeRequest,
    FreeResponse,
    HandoffRequest,
    HandoffResponse,
    Health,
    HeldBlocks,
    LookupManyRequest,
    LookupManyResponse,
    LookupRequest,
    LookupResponse,
    SessionCreate,
    SessionInfo,
    SessionList,
    SessionSummary,
)
from kvpool.server.arenas import OwnedArena, create_arenas, describe, resolve_backend
from kvpool.server.books.claims import ClaimWaits, Watch
from kvpool.server.books.pool import Pool
from kvpool.server.books.prefix import DIGESTS, token_bytes
from kvpool.server.books.processes import Peer, ProcTable
from kvpool.server.books.quarantine import Quarantine
from kvpool.server.books.records import Limits, Session, sweep_period_s
from kvpool.server.books.slabs import SlabBooks
from kvpool.server.config import PoolSettings
from kvpool.server.events.feed import KVEventsFeed, index_listing, media_of
from kvpool.server.remote.reads import RemotePeers, open_remote
from kvpool.server.tiers.tiercopy import ArenaCopier
from kvpool.server.tiers.tiermemory import HostTierMemory, blocks_view_of, open_host_tier

log = logging.getLogger(__name__)


class ControlPlane:
    def __init__(self, settings: PoolSettings, epoch: str | None = None) -> None:
        self.settings = settings
        self.epoch = epoch or secrets.token_hex(8)
        self._health: dict[bool, tuple[int, bytes]] = {}
        self._pool: Pool | None = None
        self._descriptor: ArenaDescriptor | None = None
        self.owned_arenas: list[OwnedArena] = []
        self.host_tier: HostTierMemory | None = None
        self.arena_of: dict[int, int] = {}
        self.startup_error: str | None = None
        self.claims = ClaimWaits()
        self._outbox: Outbox | None = None
        self.kv_events: KVEventsFeed | None = None
        self.remote: RemotePeers | None = None

    # -- life -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Allocate the arena and open the books (may take a while for a large CPU arena)."""
        s = self.settings
        layout = s.layout
        devices = s.device_list
        try:
            arenas, sizes = create_arenas(
                resolve_backend(s.backend), devices, layout, self.epoch,
                num_blocks=s.num_blocks, arena_bytes=s.arena_bytes, gpu_memory_fraction=s.gpu_memory_fraction,
                shm_dir=s.shm_dir, arena_handle=s.arena_handle_for_peers, fd_passing=s.fast_socket is not None,
            )  # fmt: skip
            self.owned_arenas = arenas
            if s.kv_events_endpoint is not None:
                self.kv_events = KVEventsFeed(s, sizes, arenas[0].backend)
        except Exception as exc:
            self.startup_error = f"{type(exc).__name__}: {exc}"
            log.error("%s failed: %s", "KV events" if self.owned_arenas else "arena allocation", self.startup_error)
            raise
        self.arena_of = {d: i for i, d in enumerate(devices)}
        fast = str(s.fast_socket) if s.fast_socket is not None else None
        described = describe(self.epoch, devices, arenas, sizes, layout, s.model, fast)
        self._descriptor = described.model_copy(update={"prefix_hash": s.prefix_hash})
        parts = self._descriptor.arenas
        try:
            self.host_tier = open_host_tier(s, layout, self.epoch, self._descriptor, arenas)
        except Exception as exc:
            self.startup_error = f"host tier: {type(exc).__name__}: {exc}"
            self.close()
            raise
        if self.host_tier is not None:
            self._descriptor = self.host_tier.describe(self._descriptor)
        peer_copy = None
        if s.peer_copy and len(devices) > 1:
            views = [blocks_view_of(self._descriptor.part(p.index), a) for p, a in zip(parts, arenas, strict=True)]
            copier = ArenaCopier(views)
            copier.warm()
            peer_copy = copier.copy
        if s.peer_list:  # before the books open: a pool that answers /health answers its peers too
            try:
                self.remote = open_remote(s, lambda: self.pool, self.epoch, arenas[0], parts[0])
            except Exception as exc:
                self.startup_error = f"NIXL agent: {type(exc).__name__}: {exc}"
                self.close()
                raise
        self._pool = Pool(
            sizes,
            layout,
            lease_ttl_s=s.lease_ttl_s,
            handoff_ttl_s=s.handoff_ttl_s,
            pause_slack_s=2 * sweep_period_s(s.lease_ttl_s, s.handoff_ttl_s),
            model=s.model,
            digest=DIGESTS[s.prefix_hash],
            epoch=self.epoch,
            on_handoff=self.claims.wake,
            on_session_end=self._session_ended,
            limits=Limits(**{name: getattr(s, name) for name in Limits.__dataclass_fields__}),
            index_listener=self.kv_events.listener if self.kv_events is not None else None,
            host_tier=self.host_tier.tier if self.host_tier is not None else None,
            peer_copy=peer_copy,
            quarantine=Quarantine(ProcTable(), s.lapsed_sessions),
            pins=s.pins,
            own_uid=os.getuid(),
        )
        slabs = open_slab_table(s, self._pool)
        if slabs is not None:
            self._descriptor = self._descriptor.model_copy(update={"slab_slots": slabs.slots})
        for part, arena in zip(parts, arenas, strict=True):
            log.info(
                "arena ready: %s device %s, %d blocks of %d bytes (%.1f MiB), epoch %s",
                arena.backend, part.index, part.num_blocks, layout.block_nbytes, arena.nbytes / 2**20, self.epoch,
            )  # fmt: skip

    def arena_index(self, device: int | None) -> int:
        if device is None:
            return 0
        try:
            return self.arena_of[device]
        except KeyError:
            raise InvalidRequest(f"the pool has no arena on device {device}; it has {list(self.arena_of)}") from None

    def stop_waiting(self) -> None:
        """Answer every waiting claim now with 503, and let no new claim wait: the pool is stopping."""
        self.claims.stop()

    def close(self) -> None:
        self.claims.cancel()
        if self.remote is not None:
            self.remote.close()
            self.remote = None
        if self.host_tier is not None:
            self.host_tier.close()
            self.host_tier = None
        for arena in self.owned_arenas:
            arena.close()
        self.owned_arenas = []
        if self.kv_events is not None:
            self.kv_events.close()
        if self.slabs is not None:
            self.slabs.close()
        if self._outbox is not None:
            self._outbox.close()
            self._outbox = None

    @property
    def slabs(self) -> SlabBooks | None:
        """The pool's slab books, where it serves slabs (``--slabs``)."""
        return self._pool.slabs if self._pool is not None else None

    @property
    def ready(self) -> bool:
        return self._pool is not None

    def health(self) -> tuple[int, bytes]:
        """``GET /health``'s status and body, made once for each state: what anyone may ask without the token
        costs the loop only writing it (see :class:`kvpool.server.transports.gates.RequireToken`)."""
        ready = self.ready
        answer = self._health.get(ready)
        if answer is None:
            status = "ok" if ready else "starting"
            answer = self._health[ready] = (
                200 if ready else 503,
                Health(status=status, epoch=self.epoch).model_dump_json().encode(),
            )
        return answer

    @property
    def pool(self) -> Pool:
        if self._pool is None:
            why = f": {self.startup_error}" if self.startup_error else "; retry shortly"
            raise PoolUnavailable(f"the arena is not ready{why}")
        return self._pool

    @property
    def descriptor(self) -> ArenaDescriptor:
        self.pool  # noqa: B018 - raises while starting
        assert self._descriptor is not None
        return self._descriptor

    def expire(self) -> None:
        if self.slabs is not None:
            self.slabs.settle_all()
        if self.remote is not None:
            self.remote.settle()
        if self._pool is not None:
            paused = self._pool.paused_s
            sessions, handoffs = self._pool.expire()
            if self._pool.paused_s > paused:
                log.warning(
                    "the pool did not run for %.1f s (stopped, frozen, swapped out or starved): leases and handoff "
                    "time-outs were moved on by that much, so that no client is expired for a silence the pool "
                    "could not hear", self._pool.paused_s - paused,
                )  # fmt: skip
            if sessions or handoffs:
                log.info("released %d expired sessions and %d unclaimed handoffs", sessions, handoffs)

    # -- handlers ---------------------------------------------------------------------------------------

    def open_session(self, req: SessionCreate, peer: Peer | None = None) -> SessionInfo:
        fast = self.descriptor.fast_socket
        # The pool names the inbox (in its own socket directory), so that it may delete it when the session ends.
        inbox = str(Path(fast).with_name(f"inbox-{secrets.token_hex(8)}.sock")) if req.inbox and fast else None
        session = self.pool.open_session(req.name, req.role, req.layout, inbox, req.name_key, peer)
        log.debug(
            "session %s opened by %s (%s), %s", session.session_id, req.name, req.role, peer or "no known process"
        )
        return SessionInfo(
            session_id=session.session_id,
            lease_ttl_s=self.pool.lease_ttl_s,
            epoch=self.epoch,
            fast_socket=fast,
            arena_fd=fast is not None and self.owned_arenas[0].fd is not None,
            inbox=inbox,
            inbox_key=session.inbox_key.hex() if inbox else None,
        )

    def _session_ended(self, session: Session) -> None:
        if session.inbox is not None:
            Path(session.inbox).unlink(missing_ok=True)

    def sessions(self, name: str | None = None) -> SessionList:
        now = self.pool.clock()
        return SessionList(
            sessions=[
                SessionSummary(name=s.name, role=s.role, inbox=s.inbox, age_s=round(now - s.created_at, 3))
                for s in self.pool.live_sessions(name)
            ]
        )

    def heartbeat(self, session_id: str, peer: Peer | None = None) -> SessionInfo:
        self.pool.heartbeat(session_id, peer)
        return SessionInfo(session_id=session_id, lease_ttl_s=self.pool.lease_ttl_s, epoch=self.epoch)

    def held(self, session_id: str) -> HeldBlocks:
        if self.slabs is not None:  # what its slab handed moves on first, as before any call that names blocks
            self.slabs.settle_session(session_id)
        return HeldBlocks.model_construct(block_ids=self.pool.held(session_id))

    def arena_fd(self, req: ArenaFdRequest) -> tuple[ArenaFdResponse, int]:
        """A VMM arena's fd, for a live session only: the fast channel attaches it to the reply."""
        self.pool.heartbeat(req.session_id)
        i = self.arena_index(req.device)
        arena = self.owned_arenas[i]
        if arena.fd is None:
            raise InvalidRequest(
                f"this pool's arena is shared by {arena.handle_kind}, not by file descriptor: map it from the "
                "descriptor's handle (PoolClient.arena() does)"
            )
        part = self.descriptor.arenas[i]
        answer = ArenaFdResponse(epoch=self.epoch, index=part.index, nbytes=arena.nbytes, descriptor=self.descriptor)
        return answer, arena.fd

    def close_session(self, session_id: str) -> dict[str, int]:
        return {"released": self.pool.close_session(session_id)}

    # Replies are built with model_construct: their values come from the pool's own books, and validating
    # thousands of ids again would cost more than the call itself.

    def alloc(self, req: AllocRequest) -> AllocResponse:
        ids = self.pool.alloc(req.session_id, req.num_blocks, self.arena_index(req.device))
        return AllocResponse.model_construct(block_ids=ids)

    def free(self, req: FreeRequest) -> FreeResponse:
        return FreeResponse(freed=self.pool.free(req.session_id, req.block_ids))

    def commit(self, req: CommitRequest) -> CommitResponse:
        r = self.pool.commit(req.session_id, req.block_ids, req.token_seq(), req.salt, req.start, req.release)
        return CommitResponse(committed=r.committed, duplicates=r.duplicates, num_blocks=r.num_blocks,
                              missing=r.missing)  # fmt: skip

    def lookup(self, req: LookupRequest) -> LookupResponse:
        r = self.pool.lookup(req.session_id, req.token_seq(), self.arena_index(req.device), req.salt)
        return LookupResponse.model_construct(block_ids=r.block_ids, num_tokens=r.num_tokens)

    def lookup_many(self, req: LookupManyRequest) -> LookupManyResponse:
        """Each lookup in order; the session, device and every token id are checked before any ref is taken, so
        a refused call changes nothing."""
        arena = self.arena_index(req.device)
        self.pool.session(req.session_id)
        for x in req.lookups:
            token_bytes(x.token_seq())
        hits = self.pool.lookup_many(req.session_id, [(x.token_seq(), x.salt) for x in req.lookups], arena)
        return LookupManyResponse.model_construct(
            hits=[LookupResponse.model_construct(block_ids=r.block_ids, num_tokens=r.num_tokens) for r in hits]
        )

    def handoff(self, req: HandoffRequest, packed: array | None = None) -> HandoffResponse:
        """Park the handoff; if its addressee has an inbox, send it the ids at once, sealed, before answering.

        The pool sends the delivery itself, right after its books took the handoff: the seal (a MAC with the key
        only the addressee was given) then vouches that these ids were parked for it, so an inbox takes nothing
        else, and the ids reach a consumer spinning on its inbox without waiting for the producer to wake up.
        ``packed`` are the ids as they came (int64, fenced: the books checked them), when they came packed. Each
        delivery is numbered in its addressee's sequence, so that its inbox refuses a replay of an older one.
        """
        pool = self.pool
        h = pool.handoff(req.session_id, req.request_id, req.block_ids, req.num_tokens, req.meta, req.ttl_s, req.to,
                         req.keep, req.sealed)  # fmt: skip
        addressee = pool.addressee(h)
        if addressee is None or addressee.inbox is None:
            return HandoffResponse(request_id=h.request_id, num_blocks=len(h.block_ids))
        ids = memoryview(packed).cast("B") if packed is not None else pack_ids(h.block_ids)
        assert ids is not None  # the books checked them: fenced ids fit in int64
        addressee.deliveries += 1
        datagram = encode_delivery(self.epoch, h.request_id, ids, h.num_tokens, h.meta_json, addressee.deliveries,
                                   parked_by=h.parked_by)  # fmt: skip
        seal = seal_delivery(addressee.inbox_key, datagram)
        self._outbox = self._outbox or Outbox()
        self._outbox.send(addressee.inbox, b"".join((memoryview(datagram)[:-SEAL_BYTES], seal)))
        return HandoffResponse(request_id=h.request_id, num_blocks=len(h.block_ids), inbox=addressee.inbox)

    def count_exceeded(self, limit: str) -> None:
        """Count a call refused for a limit the transport enforces itself (``kvpool_limits_exceeded``)."""
        if self.ready:
            self.pool.limits_exceeded[limit] += 1

    def refuse(self, request_id: str, why: str, by: str) -> None:
        """Remember that an addressed handoff was refused before it reached the books, for its claimer to learn."""
        self.pool.refuse(request_id, why, by)

    async def claim(self, req: ClaimRequest, watch: Watch | None = None) -> ClaimResponse:
        """Claim now, or wait up to ``timeout_s`` for a matching handoff to be parked (while the claimer is there:
        see :meth:`ClaimWaits.claim`)."""
        h = await self.claims.claim(self.pool, req, watch)
        return ClaimResponse.model_construct(
            request_id=h.request_id, block_ids=h.block_ids, num_tokens=h.num_tokens, meta=h.meta, parked_by=h.parked_by
        )

    async def accept(self, req: ClaimRequest, watch: Watch | None = None) -> AcceptResponse:
        """A claim whose claimer already has the ids (its producer sent them directly): answered without them."""
        h = await self.claims.claim(self.pool, req, watch)
        return AcceptResponse(request_id=h.request_id, num_blocks=len(h.block_ids), num_tokens=h.num_tokens)

    def stats(self) -> dict[str, Any]:
        events = {"kv_events": self.kv_events.stats()} if self.kv_events is not None else {}
        slabs = self.slabs.stats() if self.slabs is not None else None
        tables = {"slabs": slabs} if slabs is not None else {}
        remote = {"remote": self.remote.stats()} if self.remote is not None else {}
        return {**self.pool.stats(), "claims_waiting": self.claims.waiting, **events, **tables, **remote}

    def prefix_blocks(self, limit: int) -> dict[str, Any]:
        d = self.descriptor
        starts, media = [part.first_block for part in d.arenas], media_of(d.backend, len(d.arenas))
        return index_listing(self.pool.index, starts, media, self.settings.kv_events_hashes, limit)


def open_slab_table(settings: PoolSettings, pool: Pool) -> SlabBooks | None:
    """The slab table of a pool that serves slabs (``--slabs``), opened in its books; None if it does not."""
    if not settings.slabs:
        return None
    sock = settings.fast_socket or settings.socket
    books = pool.open_slabs(settings.shm_dir, settings.slab_regions, settings.slab_max_blocks,
                            sock.parent if sock is not None else None)  # fmt: skip
    log.info("slab table at %s: %d regions of %d slots", books.path, len(books.table), books.slots)
    return books
