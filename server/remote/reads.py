"""Pools on other nodes: a handoff parked there claimed here, a prefix held there read into this arena.

The peer's pool is asked over its HTTP API, on a session of this pool's there, for block ids (a claim, or
``/remote/chain``: a lookup with its chain hashes); this pool allocates its own blocks, and its NIXL agent reads the
peer's blocks straight into them, one descriptor per run of ids contiguous on both sides (:mod:`kvpool.runs`). Then
the session at the peer ends, which releases the peer's blocks. KV bytes never cross HTTP.

While a read runs its blocks belong to the read (holder ``n:read:<n>``), not to the caller: a caller that goes away
meanwhile cannot free blocks that a peer is still writing. A read that fails gives them back at once; one that
does not finish in ``--peer-timeout-s`` answers 504 and keeps them (holder ``n:stalled:<n>``, counted in use) until
NIXL says the read ended: a stalled peer that wakes up still writes into them (seen over UCX TCP after the handle
was released and the peer removed), so they must not reach another holder before. Each expiry sweep asks again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from kvpool import vmm
from kvpool.errors import HandoffNotFound, InvalidRequest, KvpoolError, PeerFailed, PeerTimeout, UnknownSession
from kvpool.ids import block_of
from kvpool.protocol import ArenaPart
from kvpool.remote_protocol import (
    AgentInfo,
    ChainResponse,
    RemoteClaimRequest,
    RemoteClaimResponse,
    RemoteLookupRequest,
    RemoteLookupResponse,
)
from kvpool.runs import Geometry, descriptors
from kvpool.server.arenas import OwnedArena
from kvpool.server.books.pool import Pool
from kvpool.server.books.prefix import token_bytes
from kvpool.server.config import PoolSettings
from kvpool.server.remote.nixlagent import NixlAgent

log = logging.getLogger(__name__)

#: how long a read in flight is polled in a row before the loop serves others: asking NIXL is also what moves the
#: read on (UCX progresses on the caller's thread), so a read polled seldom moves slowly
SPIN_S = 0.001


@dataclass
class Peer:
    url: str
    info: AgentInfo
    name: str  # in this pool's NIXL agent

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.info.base, self.info.num_blocks, self.info.layout)


@dataclass
class RemoteCounts:
    reads: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    descriptors: int = 0
    read_s: float = 0.0
    failed: int = 0
    timed_out: int = 0
    chain_mismatch: int = 0
    claim_indexed: int = 0  # blocks read for claims and indexed here


class _Stalled(Exception):
    def __init__(self, handle: Any) -> None:
        self.handle = handle


class RemotePeers:
    def __init__(self, settings: PoolSettings, pool: Callable[[], Pool], agent: NixlAgent, info: AgentInfo) -> None:
        self.settings = settings
        self.pool = pool
        self.agent = agent
        self.info = info
        self.geometry = Geometry(info.base, info.num_blocks, info.layout)
        self.timeout = settings.peer_timeout_s
        token = settings.token.get_secret_value() if settings.token else ""
        self.http = httpx.AsyncClient(headers={"authorization": f"Bearer {token}"}, timeout=self.timeout)
        self.peers: dict[str, Peer] = {}
        self.stalled: list[tuple[str, Any, str]] = []  # (holder, NIXL handle, peer agent)
        self.reading: set[str] = set()  # holders of the reads in flight
        self.counts = RemoteCounts()
        self._seq = itertools.count()

    # -- what peers ask -----------------------------------------------------------------------------------

    def chain(self, session_id: str, token_ids: Sequence[int], salt: str | None) -> ChainResponse:
        """A lookup for a peer, with the hashes of the blocks it found."""
        pool = self.pool()
        hit = pool.lookup(session_id, token_ids, 0, salt)
        n = len(hit.block_ids)
        hashes = self._hashes(token_ids[: n * pool.layout.block_size], salt)
        return ChainResponse(block_ids=hit.block_ids, num_tokens=hit.num_tokens, hashes=hashes)

    def _hashes(self, tokens: Sequence[int], salt: str | None) -> list[str]:
        """The chain hashes of ``tokens``' full blocks as this pool computes them (its first arena's), as the wire
        carries them: what a peer's chain is checked against."""
        return [h.hex() for h in self.pool().hashers[0].block_hashes(tokens, salt)]

    # -- what consumers ask ---------------------------------------------------------------------------------

    async def claim(self, req: RemoteClaimRequest) -> RemoteClaimResponse:
        pool = self.pool()
        pool.session(req.session_id)
        if req.token_ids is not None:
            token_bytes(req.token_ids)  # refused before anything is claimed
        peer = await self._peer(req.peer)
        async with self._session_at(peer) as sid:
            body = {"session_id": sid, "request_id": req.request_id, "timeout_s": req.timeout_s}
            got = await self._call(peer, "POST", "/claim", body, wait_s=req.timeout_s)
            t0 = time.perf_counter()
            theirs = [block_of(i) for i in got["block_ids"]]
            ids, ndesc = await self._read(req.session_id, peer, theirs)
            took = time.perf_counter() - t0
            indexed = await self._vouched(req, peer, sid, theirs, ids) if req.token_ids else 0
        return RemoteClaimResponse(request_id=got["request_id"], block_ids=ids, num_tokens=got["num_tokens"],
                                   meta=got["meta"], parked_by=got.get("parked_by"), descriptors=ndesc,
                                   read_s=took, indexed=indexed)  # fmt: skip

    async def _vouched(self, req: RemoteClaimRequest, peer: Peer, sid: str, theirs: list[int],
                       mine: list[int]) -> int:  # fmt: skip
        """Index the blocks read for a claim under the prompt's chain, as far as the peer's own index vouches for
        them: its chain for the prompt, asked on the session that holds the claimed blocks, names those very
        blocks in the same places, with this pool's hashes of the prompt. How many blocks were indexed."""
        pool, bs = self.pool(), self.pool().layout.block_size
        tokens = list(req.token_ids or [])[: len(mine) * bs]
        if len(tokens) < bs:
            return 0
        want = self._hashes(tokens, req.salt)
        try:
            got = await self._call(peer, "POST", "/remote/chain", {"session_id": sid, "token_ids": tokens,
                                                                    "salt": req.salt})  # fmt: skip
            n = 0
            for held, claimed, theirs_hash, ours in zip(got["block_ids"], theirs, got["hashes"], want, strict=False):
                if block_of(held) != claimed or theirs_hash != ours:
                    break
                n += 1
            if n:
                pool.commit(req.session_id, mine[:n], tokens[: n * bs], req.salt)
        except (KvpoolError, ValueError, KeyError, TypeError) as exc:  # the claim stands, unindexed
            log.warning("blocks claimed from peer %s were not indexed here: %s: %s", peer.url, type(exc).__name__, exc)
            return 0
        self.counts.claim_indexed += n
        return n

    async def lookup(self, req: RemoteLookupRequest, arena: int = 0) -> RemoteLookupResponse:
        """This pool's hit, and past it the longest further hit a peer holds, read here and indexed here under the
        chain this pool computes itself. A peer that cannot serve is named in ``peer_errors``; the answer is then
        what this pool holds (the engine computes the rest)."""
        if arena != 0:
            raise InvalidRequest(f"device {req.device} is this pool's arena {arena}: a remote lookup reads into the "
                                 "first arena only; look up with device null or the first of --devices")  # fmt: skip
        pool, tokens = self.pool(), req.token_seq()
        for url in req.peers or []:
            self._listed(url)
        bs = pool.layout.block_size
        full = len(tokens) // bs
        hit = pool.lookup(req.session_id, tokens, 0, req.salt)
        ids, errors = list(hit.block_ids), {}
        if len(ids) == full:
            return RemoteLookupResponse(block_ids=ids, num_tokens=hit.num_tokens)
        want = self._hashes(tokens[: full * bs], req.salt)
        for url in req.peers or self.settings.peer_list:
            k = len(ids)
            try:
                new = await self._prefix(req, url, tokens[: full * bs], want, k)
            except (KvpoolError, ValueError) as exc:  # ValueError: a peer's answer that is not what it should be
                errors[url] = f"{type(exc).__name__}: {exc}"
                continue
            if new:
                pool.commit(req.session_id, new, tokens[: (k + len(new)) * bs], req.salt, start=k)
                return RemoteLookupResponse(block_ids=ids + new, num_tokens=(k + len(new)) * bs,
                                            read_blocks=len(new), peer=url, peer_errors=errors)  # fmt: skip
        return RemoteLookupResponse(block_ids=ids, num_tokens=len(ids) * bs, peer_errors=errors)

    async def _prefix(self, req: RemoteLookupRequest, url: str, tokens: Sequence[int], want: list[str],
                      k: int) -> list[int]:  # fmt: skip
        peer = await self._peer(url)
        async with self._session_at(peer) as sid:
            got = await self._call(peer, "POST", "/remote/chain",
                                   {"session_id": sid, "token_ids": list(tokens), "salt": req.salt})  # fmt: skip
            remote, hashes = got["block_ids"], got["hashes"]
            if len(hashes) != len(remote) or hashes != want[: len(hashes)]:
                self.counts.chain_mismatch += 1
                raise PeerFailed(f"peer {url} answered a chain that does not match this pool's hashes of the "
                                 "prompt (another model, layout or prefix hash?): nothing was installed")  # fmt: skip
            if len(remote) <= k:
                return []
            ids, _ = await self._read(req.session_id, peer, [block_of(i) for i in remote[k:]])
            return ids

    # -- the read ---------------------------------------------------------------------------------------

    async def _read(self, session_id: str, peer: Peer, remote: list[int]) -> tuple[list[int], int]:
        """New blocks for the session holding ``remote``'s KV (fenced ids), and the descriptors the read took."""
        pool = self.pool()
        session = pool.session(session_id)
        if not remote:
            return [], 0
        fenced = pool.alloc(session_id, len(remote))
        local = pool.unfence(fenced, session.holder)
        holder = f"n:read:{next(self._seq)}"
        pool.allocator.transfer(session.holder, holder, local)
        start = pool.allocator.starts[0]
        try:
            mine, theirs = descriptors(self.geometry, [b - start for b in local], peer.geometry,
                                       [b - peer.info.first_block for b in remote])  # fmt: skip
        except ValueError as exc:
            pool.allocator.release_holder(holder)
            raise PeerFailed(f"peer {peer.url}: {exc}") from None
        t0 = time.perf_counter()
        self.reading.add(holder)
        try:
            await self._transfer(peer, mine, theirs)
        except _Stalled as stalled:
            pool.allocator.transfer(holder, stalled_holder := holder.replace("read", "stalled"), local)
            self.stalled.append((stalled_holder, stalled.handle, peer.name))
            self.counts.timed_out += 1
            self.peers.pop(peer.url, None)
            raise PeerTimeout(f"reading {len(local)} blocks from peer {peer.url} did not finish within "
                              f"{self.timeout} s (--peer-timeout-s): the peer is stalled or the link is down; "
                              "nothing was installed, recompute or retry") from None  # fmt: skip
        except PeerFailed:
            pool.allocator.release_holder(holder)
            self.counts.failed += 1
            self._forget(peer)
            raise
        finally:
            self.reading.discard(holder)
        c = self.counts
        c.reads += 1
        c.read_blocks += len(local)
        c.read_bytes += sum(n for _, n in mine)
        c.descriptors += len(mine)
        c.read_s += time.perf_counter() - t0
        if pool.sessions.get(session_id) is not session:
            pool.allocator.release_holder(holder)
            raise UnknownSession(f"session {session_id} ended while its blocks were read from {peer.url}")
        pool.allocator.transfer(holder, session.holder, local)
        return fenced, len(mine)

    async def _transfer(self, peer: Peer, mine: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> None:
        try:
            handle = self.agent.post_read(peer.name, mine, theirs, peer.info.memory)
        except Exception as exc:  # NIXL's own error types
            raise PeerFailed(f"reading from peer {peer.url} failed to start: {type(exc).__name__}: {exc}") from None
        deadline = time.monotonic() + self.timeout
        spin = time.monotonic() + SPIN_S
        while True:
            state, why = self.agent.state(handle)
            if state == "DONE":
                self.agent.release(handle)
                return
            if state == "ERR":
                self.agent.release(handle)
                raise PeerFailed(f"reading from peer {peer.url} failed ({why}): the peer died or the link broke; "
                                 "nothing was installed, recompute or retry")  # fmt: skip
            now = time.monotonic()
            if now > deadline:
                raise _Stalled(handle)
            if now > spin:
                await asyncio.sleep(0)
                spin = time.monotonic() + SPIN_S

    def _forget(self, peer: Peer) -> None:
        """Drop a failed peer's agent, unless a stalled read of it is pending: that read's end must still be seen
        (once the agent is removed NIXL calls the read failed, yet the peer, woken up, still writes its blocks)."""
        self.peers.pop(peer.url, None)
        if all(name != peer.name for _, _, name in self.stalled):
            self.agent.forget(peer.name)

    def settle(self) -> int:
        """Give back the blocks of stalled reads that NIXL now says ended (done or failed); how many reads."""
        pool, left, ended = self.pool(), [], 0
        for holder, handle, name in self.stalled:
            state, _ = self.agent.state(handle)
            if state == "PROC":
                left.append((holder, handle, name))
                continue
            self.agent.release(handle)
            pool.allocator.release_holder(holder)
            ended += 1
        self.stalled = left
        return ended

    # -- peers ------------------------------------------------------------------------------------------

    def _listed(self, url: str) -> str:
        url = url.rstrip("/")
        if url not in self.settings.peer_list:
            raise InvalidRequest(f"{url!r} is not a peer of this pool: --peers lists {self.settings.peer_list}")
        return url

    async def _peer(self, url: str) -> Peer:
        url = self._listed(url)
        peer = self.peers.get(url)
        if peer is None:
            try:
                info = AgentInfo.model_validate(await self._call_url(url, "GET", "/remote/agent", None))
            except ValueError as exc:
                raise PeerFailed(f"peer {url} answered /remote/agent with what is no agent: {exc}") from None
            try:
                name = self.agent.connect(info.metadata)
            except Exception as exc:  # NIXL's own error types
                raise PeerFailed(f"peer {url}'s NIXL agent metadata was refused: {type(exc).__name__}: {exc}") from None
            peer = self.peers[url] = Peer(url, info, name)
        return peer

    @contextlib.asynccontextmanager
    async def _session_at(self, peer: Peer) -> AsyncIterator[str]:
        """A session at the peer for one call; ending it releases what it still holds there (the blocks read)."""
        got = await self._call(peer, "POST", "/sessions", {"name": f"peer-{self.info.epoch}", "role": "other"})
        sid = got["session_id"]
        try:
            yield sid
        finally:
            with contextlib.suppress(KvpoolError):  # unanswered: the peer's lease expiry releases them instead
                await self._call(peer, "DELETE", f"/sessions/{sid}", None)

    async def _call(self, peer: Peer, method: str, path: str, body: Any, wait_s: float = 0.0) -> Any:
        try:
            return await self._call_url(peer.url, method, path, body, wait_s)
        except PeerFailed:
            self.peers.pop(peer.url, None)
            raise

    async def _call_url(self, url: str, method: str, path: str, body: Any, wait_s: float = 0.0) -> Any:
        try:
            r = await self.http.request(method, url + path, json=body, timeout=self.timeout + wait_s)
        except httpx.TimeoutException:
            raise PeerTimeout(f"peer {url} did not answer {method} {path} within {self.timeout + wait_s:.1f} s "
                              "(--peer-timeout-s)") from None  # fmt: skip
        except httpx.HTTPError as exc:
            raise PeerFailed(f"peer {url} cannot be reached ({type(exc).__name__}: {exc})") from None
        if r.status_code >= 400:
            try:
                detail = r.json().get("detail")
            except ValueError:
                detail = r.text[:200]
            error = HandoffNotFound if r.status_code == 404 and path == "/claim" else PeerFailed
            raise error(f"peer {url} answered {method} {path} with {r.status_code}: {detail}")
        return r.json()

    def stats(self) -> dict[str, Any]:
        c = self.counts
        allocator = self.pool().allocator
        held = sum(len(allocator.held(h)) for h, _, _ in self.stalled)
        reading = sum(len(allocator.held(h)) for h in self.reading)
        return {**c.__dict__, "peers": sorted(self.peers), "reads_in_flight": len(self.reading),
                "reading_blocks": reading, "stalled_reads": len(self.stalled), "stalled_blocks": held}  # fmt: skip

    async def aclose(self) -> None:
        await self.http.aclose()

    def close(self) -> None:
        self.agent.close()


def open_remote(settings: PoolSettings, pool: Callable[[], Pool], epoch: str, arena: OwnedArena,
                part: ArenaPart) -> RemotePeers:  # fmt: skip
    """The pool's NIXL agent with its first arena registered, and its answer to peers. A CPU arena is mapped here
    once more (the pool keeps no mapping of its own), for as long as the agent lives."""
    if arena.backend == "cpu":
        import numpy as np

        mapping = np.memmap(arena.handle, dtype=np.uint8, mode="r+", shape=(arena.nbytes,))
        base, memory, device = int(mapping.ctypes.data), "DRAM", 0
    else:
        assert arena.device is not None
        mapping, base, memory, device = None, arena.mapped(), "VRAM", arena.device.index  # type: ignore[attr-defined]
    rdma = vmm.rdma_capable(device) if arena.handle_kind == "vmm" else None
    agent = NixlAgent(f"kvpool-{epoch}", base, arena.nbytes, memory, device)  # type: ignore[arg-type]
    agent.keep = mapping
    info = AgentInfo(epoch=epoch, agent=agent.name, metadata=agent.metadata(), memory=memory,  # type: ignore[arg-type]
                     device=device, base=base, num_blocks=part.num_blocks, first_block=part.first_block,
                     block_nbytes=settings.layout.block_nbytes, layout=settings.layout,
                     gpu_direct_rdma=rdma)  # fmt: skip
    return RemotePeers(settings, pool, agent, info)
