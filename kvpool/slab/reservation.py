"""A session's reservation slab, the client's side: alloc and free of uncommitted blocks without a round trip.

Past 400 lines on purpose: alloc, free, refill and drain share one lock and one slab's slot arrays, and each must
see the others' effects in order.

The pool grants the slab blocks in bulk (they are this session's in its books); ``alloc`` takes idle ones and
``free`` puts them back, each writing the slots' states into the session's region of the slab table
(:mod:`kvpool.slab.table`) so that the pool can see them. The slab refills when it runs below ``low`` idle blocks and
drains back to ``blocks`` when it grows past ``high``, one call each; when the pool raises the region's ``want``
flag, the next alloc or free returns every idle block first. Blocks that leave the slab through the pool (commit,
a handoff through the pool) are forgotten here first, and then are plain session blocks.

A block freed into the slab gets its next generation there, as one freed into the pool does, so an id kept past
its free is stale in the slab too; the pool takes the slot's generation into its books before it acts on the block
(see docs/operations.md, "Slabs").
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvpool.errors import InvalidRequest, NotOwner, PoolExhausted, StaleBlock, UnknownSession
from kvpool.ids import BLOCK_MASK, GEN_STEP, MAX_ID
from kvpool.slab.protocol import (
    SLAB_BLOCKS,
    SLAB_REGION,
    SLAB_SETTLE,
    RegionInfo,
    RegionRequest,
    SettleRequest,
    SlabRequest,
)
from kvpool.slab.table import ALLOCATED, DONE, EMPTY, HANDED, IDLE, NONCE, WANT, TableView
from kvpool.transport import Transport

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how long a slab waits before it asks again ahead of need, after the pool had nothing to give
AHEAD_BACKOFF_S = 0.1


@dataclass(frozen=True, slots=True)
class SlabConfig:
    """How many idle blocks a slab keeps: refilled to ``blocks`` below ``low``, drained to it above ``high``;
    whether handoffs to consumers that read this slab's ring go through it (``ring``) or as datagrams; and whether
    the session hands off slab to slab at all (``handoffs``: False keeps alloc and free local and sends every
    handoff and claim through the pool, where a burst of them goes in one write, as a resident vLLM engine does)."""

    blocks: int = 256
    low: int = 32
    high: int = 1024
    ring: bool = True
    handoffs: bool = True
    #: the arena its blocks come from, as the pool names the device (a pool with ``--devices``); None: the first
    device: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.blocks <= self.high or self.blocks < 1:
            raise InvalidRequest(
                f"a slab needs 0 <= low <= blocks <= high and blocks >= 1, got low={self.low}, blocks={self.blocks}, "
                f"high={self.high} (KVPOOL_SLAB_LOW, KVPOOL_SLAB_BLOCKS, KVPOOL_SLAB_HIGH)"
            )

    @classmethod
    def resolve(cls, slab: SlabConfig | bool | None) -> SlabConfig | None:
        """A client's ``slab`` argument: a config, True (the defaults), False (none) or None (the environment)."""
        if slab is None:
            return cls.from_env()
        return cls() if slab is True else slab or None

    @classmethod
    def from_env(cls) -> SlabConfig | None:
        """``KVPOOL_SLAB_BLOCKS`` (unset or 0: no slab), ``KVPOOL_SLAB_LOW``, ``KVPOOL_SLAB_HIGH`` and
        ``KVPOOL_SLAB_RING`` (0: handoffs go as datagrams)."""
        try:
            blocks = int(os.environ.get("KVPOOL_SLAB_BLOCKS") or 0)
            if blocks <= 0:
                return None
            low = int(os.environ.get("KVPOOL_SLAB_LOW") or max(1, blocks // 8))
            high = int(os.environ.get("KVPOOL_SLAB_HIGH") or 4 * blocks)
            ring = int(os.environ.get("KVPOOL_SLAB_RING") or 1) != 0
        except ValueError as exc:
            raise InvalidRequest(f"KVPOOL_SLAB_BLOCKS, _LOW, _HIGH and _RING must be integers: {exc}") from None
        return cls(blocks, low, high, ring)


def as_ids(ids: Sequence[int] | Any) -> np.ndarray:
    if type(ids).__module__.startswith("torch"):
        ids = ids.cpu().numpy()
    try:
        arr = np.fromiter(ids, np.int64, len(ids)) if type(ids) is list else np.asarray(ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        raise InvalidRequest("block ids must be integers that fit in int64") from None
    if arr.ndim != 1:
        raise InvalidRequest(f"block ids must be a flat sequence, got shape {arr.shape}")
    return arr


class Slab:
    """This session's slab and its region; ``lock`` orders alloc, free and handoffs across threads."""

    def __init__(self, transport: Transport, session_id: str, epoch: str, config: SlabConfig, info: RegionInfo) -> None:
        self.transport = transport
        self.session_id = session_id
        self.config = config
        self.info = info
        self.view = TableView(info.table, info.region, epoch)
        self.mine = self.view.mine
        slots = self.mine["slots"]
        self.block, self.state = slots["block"], slots["state"]
        self.seq = slots["seq"]
        self.settled = self.mine["settled"]
        #: the slots as four 8-byte words each: block, state | to_region << 32, seq, to_nonce (see kvpool.slab.table)
        self.words = np.frombuffer(self.mine["slots"].data, "<u8").reshape(-1, 4)
        self.capacity = info.slots
        self.slot_of = np.full(info.num_blocks, -1, np.int32)
        self.slot_at = memoryview(self.slot_of)  # the same, for one id at a time
        self.idle = np.empty(self.capacity, np.int32)
        self.top = 0
        self._scratch = np.empty(self.capacity, np.int32)
        self._order = np.arange(self.capacity, dtype=np.int32)
        self.empty = list(range(self.capacity - 1, -1, -1))
        self.handed = 0
        self.lock = threading.RLock()
        self._holding = 0  # threads inside ``holding``: the pool's want waits until they are out
        self._hold = _Holding(self)
        self.closed = False
        self._ahead: ThreadPoolExecutor | None = None
        self._topping = False  # a refill ahead of need is on its way (its slots are out of ``empty`` meanwhile)
        self._ahead_after = 0.0  # after a refill ahead failed (a full pool), none until then (monotonic)
        self._wanted = config.blocks  # idle blocks the last refill ahead of need was asked for
        self._ahead_min = max(config.low, config.blocks // 4)  # what a refill ahead of need asks for at least
        #: slots whose blocks a call on its way gives up at the pool (``leave``): no other call may name them
        self._leaving: set[int] = set()

    @classmethod
    def open(cls, transport: Transport, session_id: str, epoch: str, config: SlabConfig) -> Slab:
        info = transport.fetch(SLAB_REGION, RegionRequest(session_id=session_id))
        return cls(transport, session_id, epoch, config, info)

    @property
    def num_idle(self) -> int:
        return self.top

    # -- alloc and free ---------------------------------------------------------------------------------

    def alloc(self, n: int) -> list[int] | None:
        """``n`` blocks from the slab (refilled first if it would fall below ``low``); None if it cannot hold them.
        Idle blocks are always served: ``num_idle`` is what an engine is told it may take (a refill ahead for a
        burst's prompts can hold more than half the slab), and a large ask it holds must not go to the pool."""
        with self.lock:
            self._answer_want()
            if n > self.capacity // 2 and n > self.top:
                return None
            if self.top - n < self.config.low:
                try:
                    self._refill(self.config.blocks + n - self.top)
                except PoolExhausted:
                    if self.top < n:
                        raise
                if self.top < n:
                    return None
            top = self.top
            if n == 1:
                slot = int(self.idle[top - 1])
                self.top = top - 1
                words = self.view.words
                words[9 + 4 * slot] = ALLOCATED
                return [words[8 + 4 * slot]]
            taken = self._run(self.idle[top - n : top][::-1])  # ascending slots (the stack holds them descending)
            self.top = top - n
            self.state[taken] = ALLOCATED
            return self.block[taken].tolist()

    def free(self, ids: Sequence[int] | Any, in_pool: Callable[[list[int]], int]) -> int:
        """Free ``ids``: the slab's allocated blocks among them back into the slab, the others through
        ``in_pool``, and none of either if the pool refuses its share (a rejected call changes nothing).

        Where none is the slab's, the round trip runs without the lock: another thread's allocs and frees from the
        slab go on meanwhile (an engine releases its refs on the pool's blocks off its scheduler's thread, which
        must not wait for that). Ids this session holds are not free in the pool, so no refill can bring one into
        the slab before the pool has them back."""
        if len(ids) == 1:
            fenced = int(ids[0])
            block = fenced & BLOCK_MASK
            with self.lock:
                self._answer_want()
                slot = self.slot_at[block] if 0 <= block < len(self.slot_at) and fenced >= 0 else -1
                if slot >= 0:
                    words = self.view.words
                    if words[8 + 4 * slot] != fenced:
                        raise self._stale([fenced])
                    if slot in self._leaving:
                        raise self._in_flight()
                    if words[9 + 4 * slot] & 0xFFFFFFFF != ALLOCATED:
                        raise self._not_held([fenced])
                    nxt = fenced + GEN_STEP
                    words[8 + 4 * slot] = nxt if nxt <= MAX_ID else block
                    words[9 + 4 * slot] = IDLE
                    self.idle[self.top] = slot
                    self.top += 1
                    self._trim()
                    return 1
            return in_pool([fenced])
        arr = as_ids(ids)
        with self.lock:
            self._answer_want()
            slots, at = self._owned(arr)
            local = slots >= 0
            if local.any():  # held across the pool's share, so that nothing moves the slab's share meanwhile
                freed, mine = (0, slots) if local.all() else (in_pool(arr[~local].tolist()), slots[local])
                old = self.block[at]
                wrap = old > MAX_ID - GEN_STEP
                self.block[at] = np.where(wrap, old & BLOCK_MASK, old + GEN_STEP) if wrap.any() else old + GEN_STEP
                self.state[at] = IDLE
                # a run goes back lowest slot on top, as refill stacks them: the next alloc of it is a run again
                self.idle[self.top : self.top + len(mine)] = mine if type(at) is not slice else mine[::-1]
                self.top += len(mine)
                self._trim()
                return freed + len(mine)
        return in_pool(arr.tolist())

    def _owned(self, arr: np.ndarray) -> tuple[np.ndarray, np.ndarray | slice]:
        """The slot of each id that names a block of this slab, else -1 (a block the pool has to answer for), and
        the slab's slots among them as an index (a slice where they are a run: see :meth:`_run`).

        Raises, changing nothing, if an id names a slab block that this session does not hold allocated: under an
        old generation (StaleBlock), or idle, that is freed already (NotOwner), or twice. Such an id must never
        reach the pool, which would take the block back while the slab still counts it as its own.
        """
        blocks = arr & BLOCK_MASK
        if len(arr) and arr.min() >= 0 and blocks.max() < len(self.slot_of):
            slots = self.slot_of[blocks]
        else:
            inside = (arr >= 0) & (blocks < len(self.slot_of))
            slots = np.where(inside, self.slot_of[np.where(inside, blocks, 0)], -1)
        ours = slots >= 0
        if ours.all():
            mine, named = slots, arr
        elif ours.any():
            mine, named = slots[ours], arr[ours]
        else:
            return slots, slots[:0]
        at = self._run(mine)
        # block, state | to_region << 32, ...: a view of a run, else one gather (take: a fifth of indexing's cost)
        rows = self.words[at] if type(at) is slice else self.words.take(at, axis=0)
        stale = rows[:, 0] != named.view(np.uint64)
        if stale.any():
            raise self._stale(named[stale].tolist())
        idle = (rows[:, 1] & 0xFFFFFFFF) != ALLOCATED
        if idle.any():
            raise self._not_held(named[idle].tolist())
        if len(mine) > self.capacity:
            raise NotOwner("block_ids lists a block of this session's slab twice: it holds one ref on each")
        if self._leaving and not self._leaving.isdisjoint(mine.tolist()):
            raise self._in_flight()
        if len(mine) > 1 and type(at) is not slice:  # a slot named twice keeps the later position only (np.unique
            # sorts: 20x dearer); a run names each slot once
            order = self._order[: len(mine)]
            self._scratch[mine] = order
            if (self._scratch[mine] != order).any():
                raise NotOwner("block_ids lists a block of this session's slab twice: it holds one ref on each")
        return slots, at

    def _run(self, slots: np.ndarray) -> np.ndarray | slice:
        """``slots`` as a slice where they are consecutive and ascending, as a request's blocks come from its
        allocs: numpy then reads and writes their rows in place, without the gathers and scatters that an index
        array costs (a 1,024-slot free took half the time)."""
        n = len(slots)
        if n > 1:
            first = int(slots[0])
            if int(slots[-1]) - first == n - 1 and (slots == self._order[first : first + n]).all():
                return slice(first, first + n)
        return slots

    def _not_held(self, ids: list[int]) -> NotOwner:
        return NotOwner(
            f"the session holds no reference on blocks {sorted(ids)[:8]}: they were freed already (back into its "
            "slab); nothing was changed"
        )

    def _in_flight(self) -> NotOwner:
        return NotOwner(
            "block_ids names a block of this session's slab that a call on its way gives up at the pool (a commit or "
            "a handoff through it): nothing was changed. Give a block up once, after that call answered"
        )

    def _stale(self, ids: list[int]) -> StaleBlock:
        return StaleBlock(
            f"block ids {ids[:8]} are stale: their blocks were freed since the call that returned them (into this "
            "session's slab, where a freed block gets its next generation as in the pool), and may hold other KV now; "
            "nothing was changed. Drop these ids: look the prefix up again or allocate anew",
            stale=tuple(ids),
        )

    def leave(self, ids: Sequence[int] | Any, call: Callable[[], T]) -> T:
        """Run ``call``, which gives these blocks up at the pool (commit, a handoff through it); once it succeeded,
        the slab's blocks among them leave the slab. Refused first, changing nothing, for ids the slab knows are
        not this session's to give; an old generation goes to the pool all the same, which refuses it too (it
        takes the slab's generations in before it checks an id) and so tells an addressee of a handoff."""
        arr = as_ids(ids)
        stale: StaleBlock | None = None
        with self.lock:
            try:
                slots, _ = self._owned(arr)
            except StaleBlock as exc:
                stale = exc
        if stale is not None:
            call()
            raise stale
        return self._leaving_during([slots], lambda: [call()])[0]  # type: ignore[return-value]

    def leave_many(self, id_lists: Sequence[Sequence[int] | Any], call: Callable[[], list[T | None]]) -> list[T | None]:
        """:meth:`leave` for several calls sent together (``call`` answers each, ``None`` where the pool refused it):
        the slab's blocks of each call that the pool took leave the slab; a refused call's blocks stay. Refused first,
        changing nothing, as ``leave`` is, if any list names a block the slab knows is not this session's to give."""
        with self.lock:
            owned = [self._owned(as_ids(ids))[0] for ids in id_lists]
        return self._leaving_during(owned, call)

    def _leaving_during(self, owned: list[np.ndarray], call: Callable[[], list[T | None]]) -> list[T | None]:
        """Run ``call`` without the lock, the slab's blocks of ``owned`` (checked under it) marked as leaving: the
        pool's round trip (a step's commits: milliseconds) must not hold the scheduler's allocs and frees, nor the
        heartbeat's answer to the pool's want. A free, a handoff or another leave naming a leaving block is refused
        meanwhile (no thread but this call's may give it up); once the pool answered, each taken call's blocks go."""
        mine = [s[s >= 0] for s in owned]
        marked = [slot for m in mine for slot in m.tolist()]
        with self.lock:
            if not self._leaving.isdisjoint(marked):
                raise self._in_flight()
            self._leaving.update(marked)
        done: list[T | None] = []
        try:
            done = call()
        finally:
            with self.lock:
                self._leaving.difference_update(marked)
                if not self.closed:
                    for slots, answer in zip(mine, done, strict=False):
                        if answer is not None:
                            self._gone(slots)
        return done

    def _gone(self, slots: np.ndarray) -> None:
        mine = slots[slots >= 0]
        if mine.size:
            self.state[mine] = EMPTY
            self.slot_of[self.block[mine] & BLOCK_MASK] = -1
            self.empty.extend(mine.tolist())

    # -- refills and drains -----------------------------------------------------------------------------

    def idle_count(self) -> int:
        """Idle blocks, refilled first if they are below ``low`` (one round trip, once per ``blocks - low``
        allocations): what an engine's scheduler may count on without asking the pool."""
        with self.lock:
            self._answer_want()
            if self.top < self.config.low:
                with contextlib.suppress(PoolExhausted):
                    self._refill(self.config.blocks - self.top)
            return self.top

    def ensure_idle(self, n: int) -> int:
        """Make ``n`` blocks idle now if the pool and the slab's room allow (one round trip); how many came."""
        with self.lock:
            before = self.top
            if n > before:
                self._refill(max(n, self.config.blocks) - before)
            return self.top - before

    def holding(self) -> _Holding:
        """Idle blocks counted inside this ``with`` stay idle until it ends, but for those this thread takes: the
        pool's want is answered after it, not within. An engine's scheduler counts its free blocks and then takes
        them within one allocation; blocks given back between the two would make it ask the pool for blocks that
        a full pool does not have, in the middle of vLLM's books. (A plain object, not a generator: vLLM allocates
        for every running request every step.)"""
        return self._hold

    def answer_want(self) -> None:
        """Give idle blocks back if the pool asked (the heartbeat calls this, so that an idle client answers too; its
        thread may come by while the client closes, and then finds nothing to do)."""
        with self.lock:
            if not self.closed:
                self._answer_want()

    def ensure_mine(self) -> None:
        """Raise if the pool took this session's region back (its lease ran out): then it may be another's now."""
        if self.view.words[NONCE] != self.info.nonce:
            raise UnknownSession(
                "this session's lease ran out and its slab went back to the pool: its ids are stale; reconnect()"
            )

    def _answer_want(self) -> None:
        """Also the check that the slab is still this session's: the pool zeroes the region of a session whose lease
        ran out, and a client paused past its lease must not go on handing out blocks the pool took back."""
        words = self.view.words
        if words[NONCE] != self.info.nonce:  # the same as ensure_mine(), inline: this is every call's path
            self.ensure_mine()
        if self._holding:
            return
        want = words[WANT]
        if want != words[DONE]:
            self._drain(0)
            words[DONE] = want

    def _trim(self) -> None:
        if self.top > self.config.high:
            self._drain(self.config.blocks)

    def _reuse_handed(self) -> None:
        """Slots whose handoff the pool has settled are empty again."""
        if not self.handed:
            return
        done = np.flatnonzero((self.state == HANDED) & (self.settled == self.seq))
        if done.size:
            self.state[done] = EMPTY
            self.empty.extend(done.tolist())
            self.handed -= len(done)

    def refill_ahead(self, want: int = 0) -> None:
        """Start a refill to ``blocks`` idle (or to ``want`` plus ``low``, if that is more: what requests that
        arrived will take) on the slab's own thread if a quarter of ``blocks`` or more is missing (at least ``low``)
        and none is on its way; returns at once. The round trip runs without the lock, so allocs and frees go on
        meanwhile: an engine's scheduler calls this once a step, and as a burst arrives, so that its allocs find the
        blocks there and no step waits for the pool (a refill under the lock is a round trip, and a pool that
        evicts to grant it can take milliseconds)."""
        self._wanted = target = max(self.config.blocks, want + self.config.low if want else 0)
        if self._topping or self.closed or target - self.top < self._ahead_min:
            return
        if self._ahead_after and time.monotonic() < self._ahead_after:
            return  # a full pool is not asked again every step
        if self._ahead is None:
            self._ahead = ThreadPoolExecutor(1, thread_name_prefix="kvpool-slab-refill")
        self._topping = True
        self._ahead.submit(self._top_up)

    def _top_up(self) -> None:
        """Refill to what was wanted last, and again while what arrived meanwhile wants more."""
        with self.lock:
            take = 0
            if not self.closed:
                self._reuse_handed()
                take = min(self._wanted - self.top, len(self.empty))
            if take <= 0:
                self._topping = False
                return
            reserved = self.empty[len(self.empty) - take :]
            del self.empty[len(self.empty) - take :]
        ids = np.empty(0, np.int64)
        try:
            ids = self._fetch(take)
        except Exception as exc:  # the next alloc that needs blocks asks again, under the lock, and raises there
            self._ahead_after = time.monotonic() + AHEAD_BACKOFF_S
            if not isinstance(exc, PoolExhausted):
                log.warning("a slab refill ahead of need failed: %s: %s", type(exc).__name__, exc)
        else:
            self._ahead_after = 0.0
        finally:
            with self.lock:
                again = False
                if not self.closed:  # else the session is over and the pool takes its blocks back
                    self.empty.extend(reserved[: take - len(ids)])
                    if len(ids):
                        self._install(ids, reserved[take - len(ids) :])
                        again = self._wanted - self.top >= self._ahead_min
                self._topping = again
        if again and self._ahead is not None:
            try:
                self._ahead.submit(self._top_up)
            except RuntimeError:  # closed meanwhile
                self._topping = False

    def _refill(self, want: int) -> None:
        self._reuse_handed()
        take = min(want, len(self.empty))
        if take <= 0:
            return
        ids = self._fetch(take)
        self._install(ids, self.empty[len(self.empty) - len(ids) :])
        del self.empty[len(self.empty) - len(ids) :]

    def _fetch(self, take: int) -> np.ndarray:
        """Up to ``take`` blocks from the pool for this slab (one round trip), as fenced ids."""
        req = SlabRequest(session_id=self.session_id, take=take, device=self.config.device)
        return np.asarray(self.transport.fetch(SLAB_BLOCKS, req).block_ids, np.int64)

    def _install(self, ids: np.ndarray, empty_slots: list[int]) -> None:
        # descending, so that allocs (from the top) hand out consecutive slots in ascending order, one alloc after
        # another: a request's blocks then sit in one run of slots, which a handoff checks at once
        slots = np.sort(np.asarray(empty_slots, np.int32))[::-1]
        self.block[slots] = ids
        self.state[slots] = IDLE
        self.slot_of[ids & BLOCK_MASK] = slots
        self.idle[self.top : self.top + len(slots)] = slots
        self.top += len(slots)

    def _drain(self, keep: int) -> None:
        if self.top <= keep:
            return
        slots = self.idle[keep : self.top].copy()
        ids = self.block[slots]
        self.transport.fetch(SLAB_BLOCKS, SlabRequest(session_id=self.session_id, give=ids.tolist()))
        self.top = keep
        self.state[slots] = EMPTY
        self.slot_of[ids & BLOCK_MASK] = -1
        self.empty.extend(slots.tolist())

    def settle(
        self, regions: Sequence[int], holds: Sequence[int] = (), took: tuple[int, int, int] | None = None
    ) -> bool:
        """Have the pool move the refs handed from ``regions`` now; whether this session holds ``holds`` (once it
        took the handoff ``took`` names, producer region, nonce and sequence, if that is in flight to it)."""
        req = SettleRequest(
            session_id=self.session_id, regions=list(regions), holds=list(holds), took=list(took) if took else None
        )
        return self.transport.fetch(SLAB_SETTLE, req).holds

    def close(self) -> None:
        with self.lock:
            self.closed = True
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
        with self.lock:
            self.view.close()


class _Holding:
    __slots__ = ("slab",)

    def __init__(self, slab: Slab) -> None:
        self.slab = slab

    def __enter__(self) -> None:
        self.slab.lock.acquire()
        self.slab._holding += 1

    def __exit__(self, *_: object) -> None:
        self.slab._holding -= 1
        self.slab.lock.release()
