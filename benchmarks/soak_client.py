"""The soak's clients: what each does, the stamps that prove who wrote a block, and the tally of the run.

Each client thread holds a session of its own and picks operations at random (alloc, free, commit, lookup,
handoff, claim) under the weights below, checking every answer against what it knows it holds. It also names ids
it let go of (``stale``: freed or handed off, their blocks since recycled or not), alone or beside one it holds,
and the pool must refuse each such call whole. Between two operations it can be paused (``lock``) and asked what it
holds (:meth:`Client.known`), which the soak compares with what the pool's books say its session holds.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import random
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.errors import (
    HandoffNotFound,
    KvpoolError,
    NotOwner,
    PoolExhausted,
    PoolRestarted,
    StaleBlock,
    UnknownSession,
)
from kvpool.ids import BLOCK_MASK, block_of
from kvpool.slab import SlabClient
from kvpool.slab.table import HANDED, IDLE

OPS = ("alloc", "free", "commit", "lookup", "handoff", "claim", "stale")
WEIGHTS = (24, 20, 12, 18, 12, 14, 6)
RETIRED_KEPT = 64  # ids a client let go of, kept to name again
FAMILIES = 6  # prompt families whose prefixes clients share
FAMILY_BLOCKS = 8  # full blocks per family prompt
MAX_REFS = 12  # a client frees before it holds more refs than this


# -- what the run records -----------------------------------------------------------------------------------


@dataclass
class Tally:
    """Counts shared by every thread (under one lock: the counts are tiny next to a pool round trip)."""

    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    violation_count: int = 0
    samples: int = 0
    book_checks: int = 0  # clients paused and compared with the pool's books of their session
    stranded: int = 0  # blocks a live session held that its client did not know of, summed over the checks
    max_in_use: int = 0
    in_use: list[tuple[float, int]] = field(default_factory=list)  # (seconds since the start, blocks in use)
    t0: float = field(default_factory=time.monotonic)
    crashed: int = 0
    pauses: int = 0  # times the pool was stopped and went on
    lost: int = 0  # calls refused because the pool lost the (heartbeating) client's session: expired, restarted
    lock: threading.Lock = field(default_factory=threading.Lock)

    def op(self, kind: str) -> None:
        with self.lock:
            self.ops[kind] += 1

    def error(self, kind: str, exc: BaseException) -> None:
        with self.lock:
            self.errors[f"{kind} {type(exc).__name__}"] += 1

    def violation(self, message: str) -> None:
        with self.lock:
            self.violation_count += 1
            if len(self.violations) < 50:
                self.violations.append(message)


class DroppedHandoffs(logging.Handler):
    """A slab handoff its consumer dropped (neither the producer's region nor the pool vouched, a sequence taken
    already, a ring it could not read) is a handoff lost: the producer was told it went. Each is a violation."""

    def __init__(self, tally: Tally) -> None:
        super().__init__(logging.WARNING)
        self.tally = tally

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("dropped"):
            self.tally.violation(f"a consumer {message}")


# -- the bytes: stamps that prove who wrote a block ---------------------------------------------------------


def content_stamp(family: int, position: int) -> int:
    """The stamp of the block at ``position`` of ``family``'s prompt: the same for every client that writes it."""
    return (1 << 60) | (family << 20) | position


def family_tokens(family: int, block_size: int) -> list[int]:
    return [(family * 7919 + k * 104729) % 50000 for k in range(FAMILY_BLOCKS * block_size)]


class Stamps:
    """Reads and writes 8 bytes at the start of a block's first K view (its own bytes in either layout)."""

    def __init__(self, arena: Any | None) -> None:
        self.arena = arena

    def _view(self, block: int) -> Any:
        import torch

        first = self.arena.block(block)[0]
        return first.reshape(-1).view(torch.uint8)[:8].view(torch.int64)

    def write(self, block: int, stamp: int) -> None:
        if self.arena is not None:
            self._view(block)[0] = stamp

    def read(self, block: int) -> int | None:
        return None if self.arena is None else int(self._view(block)[0])


# -- one client ---------------------------------------------------------------------------------------------


@dataclass
class Ref:
    block: int
    kind: str  # "own": allocated by this client, nobody else holds it; "content": committed, shareable;
    # "foreign": claimed from a handoff this run did not stamp (a killed worker's): held, not checked
    stamp: int | None


class Client:
    """One session doing random operations and checking what it gets back."""

    def __init__(self, index: int, url: str, fast: bool, shared: Shared) -> None:
        self.index = index
        self.shared = shared
        self.rng = random.Random(shared.seed * 1000 + index)
        slab = (shared.slab if fast else None) or False
        self.pool = SlabClient(url, name=f"soak-{index}", role="other", fast=fast, inbox=fast, slab=slab)
        self.stamps = Stamps(self.pool.arena() if shared.verify_data else None)
        self.refs: list[Ref] = []
        self.retired: collections.deque[int] = collections.deque(maxlen=RETIRED_KEPT)
        self.seq = 0
        self.lock = threading.Lock()  # held through each operation: whoever holds it sees the client between two
        self.closed = False

    def run(self, stop: threading.Event) -> None:
        try:
            try:
                while not stop.is_set():
                    kind = self.rng.choices(OPS, WEIGHTS)[0]
                    if len(self.refs) > MAX_REFS:
                        kind = "free"
                    with self.lock:
                        self.step(kind)
            finally:
                self.shared.all_stopped()
            with self.lock:
                self.release_all()
        except Exception:
            self.shared.tally.violation(f"client {self.index} crashed: {traceback.format_exc(limit=6)}")
        finally:
            with self.lock:
                self.closed = True
            with contextlib.suppress(Exception):
                self.pool.close()

    def known(self) -> collections.Counter[int]:
        """The blocks this client knows its session holds, by block number, once per ref: its refs, its slab's idle
        blocks and those it handed that the pool has not settled yet, and the handoffs its slab box took for a
        later claim. Called between two operations (under ``lock``, and the slab's lock if it has one)."""
        held = collections.Counter(block_of(r.block) for r in self.refs)
        slab, box = self.pool.slab, getattr(self.pool, "slab_box", None)  # a client made with a slab has one
        if slab is not None:
            mine = (slab.state == IDLE) | ((slab.state == HANDED) & (slab.settled != slab.seq))
            held.update((slab.block[mine] & BLOCK_MASK).tolist())
        if box is not None:
            for claim in box.delivered.values():
                held.update(block_of(i) for i in claim.block_ids)
        return held

    def step(self, kind: str) -> None:
        tally = self.shared.tally
        try:
            if getattr(self, f"do_{kind}")():  # False: nothing to do it on (no refs held, nothing parked)
                tally.op(kind)
        except PoolExhausted as exc:  # the contract's answer to a full pool: make room
            tally.error(kind, exc)
            if kind != "alloc":
                tally.violation(f"{kind} answered pool exhausted: {exc}")
            self.free_some()
        except HandoffNotFound as exc:  # expired, or taken first by a claim of "the oldest"
            tally.error(kind, exc)
            if kind != "claim":
                tally.violation(f"{kind} answered handoff not found: {exc}")
        except KvpoolError as exc:  # nothing else can happen to a correct client of a correct pool
            tally.error(kind, exc)
            if isinstance(exc, (UnknownSession, PoolRestarted)):
                with tally.lock:
                    tally.lost += 1
            tally.violation(f"client {self.index} {kind}: {type(exc).__name__} (status {exc.status}): {exc}")

    def check(self, ref: Ref, what: str) -> None:
        if ref.stamp is None:
            return
        got = self.stamps.read(ref.block)
        if got is not None and got != ref.stamp:
            self.shared.tally.violation(
                f"client {self.index} {what}: block {ref.block} holds stamp {got:#x}, expected {ref.stamp:#x} "
                f"({ref.kind}): someone wrote into a block this client held"
            )

    def take(self, k: int, among: list[Ref] | None = None) -> list[Ref]:
        refs = self.refs if among is None else among
        picked = self.rng.sample(range(len(refs)), min(k, len(refs)))
        return [refs[i] for i in sorted(picked)]

    def drop(self, refs: Sequence[Ref]) -> None:
        gone = {id(r) for r in refs}
        self.refs = [r for r in self.refs if id(r) not in gone]

    # -- operations -------------------------------------------------------------------------------------

    def do_alloc(self) -> bool:
        for block in self.pool.alloc(self.rng.randint(1, 4)):
            self.seq += 1
            stamp = (self.index + 1) << 40 | self.seq
            self.stamps.write(block, stamp)
            self.refs.append(Ref(block, "own", stamp))
        return True

    def do_free(self) -> bool:
        refs = self.take(self.rng.randint(1, 4))
        if not refs:
            return False
        for ref in refs:
            self.check(ref, "before free")
        freed = self.pool.free([r.block for r in refs])
        self.drop(refs)
        self.retired.extend(r.block for r in refs)
        if freed != len(refs):
            self.shared.tally.violation(f"free of {len(refs)} refs answered freed={freed}")
        return True

    def do_commit(self) -> bool:
        own = [r for r in self.refs if r.kind == "own"]  # commit only blocks this client wrote
        if not own:
            return False
        family = self.rng.randrange(FAMILIES)
        n = self.rng.randint(1, min(len(own), FAMILY_BLOCKS))
        chain = own[:n]
        for ref in chain:
            self.check(ref, "before commit")
        bs = self.shared.block_size
        for position, ref in enumerate(chain):
            ref.kind, ref.stamp = "content", content_stamp(family, position)
            self.stamps.write(ref.block, ref.stamp)
        result = self.pool.commit([r.block for r in chain], family_tokens(family, bs)[: n * bs])
        if result.num_blocks != n or result.committed + result.duplicates != n:
            self.shared.tally.violation(f"commit of {n} blocks answered {result}")
        return True

    def do_lookup(self) -> bool:
        family = self.rng.randrange(FAMILIES)
        bs = self.shared.block_size
        length = self.rng.randint(1, FAMILY_BLOCKS * bs + bs - 1)
        hit = self.pool.lookup(family_tokens(family, bs)[:length])
        if hit.num_tokens != len(hit.block_ids) * bs or hit.num_tokens > length:
            self.shared.tally.violation(f"lookup answered {hit.num_tokens} tokens for {len(hit.block_ids)} blocks")
        for position, block in enumerate(hit.block_ids):
            ref = Ref(block, "content", content_stamp(family, position))
            self.check(ref, f"prefix hit of family {family} position {position}")
            self.refs.append(ref)
        return True

    def do_handoff(self) -> bool:
        to = None
        if self.shared.addressable and self.rng.random() < 0.5:
            to = self.rng.choice(self.shared.addressable)
        own = [r for r in self.refs if r.kind == "own"]
        # an addressed handoff is mostly what this client wrote, as a prefill hands its KV (and, with slabs, what
        # can go slab to slab)
        refs = self.take(self.rng.randint(1, 3), own if to is not None and own and self.rng.random() < 0.7 else None)
        if not refs:
            return False
        for ref in refs:
            self.check(ref, "before handoff")
        self.seq += 1
        request_id = f"soak-{self.index}-{self.seq}"
        meta = {"refs": [[r.block, r.kind, r.stamp] for r in refs]}
        num_tokens = self.rng.randint(0, len(refs) * self.shared.block_size)
        ttl_s = self.shared.handoff_ttl_s
        blocks = [r.block for r in refs]
        addressee = None if to is None else f"soak-{to}"
        sent = self.pool.handoff(request_id, blocks, num_tokens, meta, ttl_s=ttl_s, to=addressee)
        if sent.slab:
            self.shared.tally.op("handoff, slab to slab")
        self.drop(refs)
        self.retired.extend(blocks)
        self.shared.park(request_id, to)
        return True

    def do_claim(self) -> bool:
        request_id = self.shared.unpark(self.rng, self.index)
        if request_id is None and self.rng.random() < 0.8:
            return False
        got = self.pool.claim(request_id, timeout_s=0.05 if request_id is None else 0.2)
        if got.direct:  # the ids came from the producer: trust them once the pool has confirmed the claim
            self.pool.confirm()
            self.shared.tally.op("claim, delivered directly")
        if "refs" not in got.meta:  # a killed worker's handoff, by its request id or taken as "the oldest"
            self.refs.extend(Ref(b, "foreign", None) for b in got.block_ids)
            if got.request_id.startswith("doomed-slab-"):
                self.shared.tally.op("claim, of a killed worker's slab handoff")
            return True
        refs = [Ref(int(b), str(k), None if s is None else int(s)) for b, k, s in got.meta["refs"]]
        if [r.block for r in refs] != got.block_ids:
            self.shared.tally.violation(f"claim of {got.request_id} answered blocks {got.block_ids}, parked {refs}")
        for ref in refs:
            self.check(ref, f"after claim of {got.request_id}")
        self.refs.extend(refs)
        return True

    def do_stale(self) -> bool:
        """Free, commit or hand off ids this client let go of, maybe beside one it holds: the pool must refuse the
        whole call (StaleBlock where the block was recycled since, NotOwner where it was not) and change nothing,
        which the books' balance and this client's next calls on what it holds would show."""
        held = {block_of(r.block) for r in self.refs}
        gone = list({b for b in self.retired if block_of(b) not in held})
        if not gone:
            return False
        ids = self.rng.sample(gone, min(len(gone), self.rng.randint(1, 3)))
        if self.refs and self.rng.random() < 0.5:
            ids.insert(self.rng.randrange(len(ids) + 1), self.rng.choice(self.refs).block)
        call = self.rng.choice(("free", "commit", "handoff"))
        bs = self.shared.block_size
        try:
            if call == "free":
                self.pool.free(ids)
            elif call == "commit":
                self.pool.commit(ids, family_tokens(0, bs)[: len(ids) * bs])
            else:
                self.seq += 1
                self.pool.handoff(f"soak-stale-{self.index}-{self.seq}", ids, 0, ttl_s=self.shared.handoff_ttl_s)
        except (StaleBlock, NotOwner) as exc:
            self.shared.tally.op(f"stale {call}, refused: {type(exc).__name__}")
            return True
        self.shared.tally.violation(f"client {self.index}: {call} of ids it let go of {ids} was not refused")
        return True

    def free_some(self) -> None:
        if self.refs:
            self.do_free()

    def release_all(self) -> None:
        while self.refs:
            self.do_free()


# -- what the clients share ---------------------------------------------------------------------------------


@dataclass
class Shared:
    tally: Tally
    block_size: int
    handoff_ttl_s: float
    seed: int
    verify_data: bool
    addressable: list[int] = field(default_factory=list)  # clients with an inbox
    slab: Any = None  # the SlabConfig of the clients with an inbox, if they have slabs
    parked: list[tuple[str, int | None]] = field(default_factory=list)  # (request id, the client it is for)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopped: threading.Barrier | None = None  # every client's loop ended

    def all_stopped(self) -> None:
        """Wait until no client may still hand anything to another: none ends its session before that (a handoff to
        a session that ended is refused, as it should be, and is no fault of the pool's)."""
        if self.stopped is not None:
            with contextlib.suppress(threading.BrokenBarrierError):
                self.stopped.wait(timeout=60)

    def park(self, request_id: str, to: int | None) -> None:
        with self.lock:
            self.parked.append((request_id, to))

    def unpark(self, rng: random.Random, me: int) -> str | None:
        """A parked request this client may claim: one for anyone, or one addressed to it."""
        with self.lock:
            mine = [i for i, (_, to) in enumerate(self.parked) if to is None or to == me]
            if not mine:
                return None
            return self.parked.pop(rng.choice(mine))[0]

    def drain(self) -> list[str]:
        with self.lock:
            ids, self.parked = [r for r, _ in self.parked], []
            return ids
