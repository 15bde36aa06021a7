"""The fence: the pool never hands out a block that a live process could still write.

A session *lapses* when its lease runs out without a close. Its process may be dead, or only stalled (SIGSTOP, a
paused container, a swap storm, a starved heartbeat thread); a stalled one resumes and writes where it last meant
to, before it learns that its lease is gone. Blocks freed at once would by then belong to another engine. So the
blocks a lapsed session could still write (uncommitted blocks it holds refs on, its slab's idle blocks among them)
are held here, under the process that opened the session, until that process is gone; committed blocks are
immutable, and are released at once as before (they stay prefix hits for everyone: KV outlives its engine). With
``kill`` (``--lapsed-sessions``), the pool also sends that process SIGKILL, to get the blocks back within a sweep.

A session whose process the pool does not know (opened over TCP, where no peer credentials exist) is released at
once, as before the fence: resident engines reach the pool over its Unix socket.

Invariants (:meth:`Quarantine.check`): each entry is held under its own allocator holder, whose refs are exactly the
entry's blocks; ``num_blocks`` is the number of distinct blocks held here; an entry leaves only once its process is
gone. Those blocks have a ref, so no allocation or eviction can take them: the allocator's books stay as they are,
and the pool reports them as ``quarantined`` instead of ``in_use``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from kvpool.server.books.processes import Peer, Processes

log = logging.getLogger(__name__)

LapsedSessions = Literal["quarantine", "kill"]


def holder_of(session_id: str) -> str:
    """The allocator holder a lapsed session's fenced blocks are held under."""
    return f"q:{session_id}"


@dataclass(slots=True)
class Fenced:
    """What one lapsed session left that its process could still write."""

    session_id: str
    name: str
    peer: Peer
    blocks: Counter[int]  # block -> refs, as the allocator holds them under ``holder``
    killed: bool = False

    @property
    def holder(self) -> str:
        return holder_of(self.session_id)


@dataclass(slots=True)
class QuarantineCounters:
    quarantines: int = 0  # lapsed sessions whose blocks were fenced
    quarantines_released: int = 0  # ... and released once their process was gone
    blocks_released: int = 0
    lapsed_killed: int = 0  # lapsed processes sent SIGKILL
    kills_refused: int = 0  # lapsed processes the pool could not kill (another user's): fenced until they exit


class Quarantine:
    def __init__(self, processes: Processes, mode: LapsedSessions = "quarantine") -> None:
        self.processes = processes
        self.mode = mode
        self.fenced: dict[str, Fenced] = {}  # by holder
        self._held: Counter[int] = Counter()  # block -> entries holding it
        self.counters = QuarantineCounters()

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held back now."""
        return len(self._held)

    def blocks(self) -> Sequence[int]:
        return list(self._held)

    def lapsed(
        self, session_id: str, name: str, peer: Peer | None, writable: Sequence[int], released: int
    ) -> str | None:
        """A session lapsed holding ``writable`` (uncommitted blocks, one entry per ref) and ``released`` committed
        refs: the holder to move ``writable``'s refs to, or None where they are released at once (no known process,
        or nothing to fence). Logs one line saying which."""
        who = f"session {session_id} ({name!r})"
        if peer is None or not peer.process or not writable or not self.processes.alive(peer):
            why = (
                "no known process (opened over TCP)" if peer is None or not peer.process
                else "nothing it could write" if not writable
                else f"its process ({peer}) gone"
            )  # fmt: skip
            log.info("%s lapsed with %s: %d blocks released, %d committed blocks kept as prefix hits",
                     who, why, len(writable), released)  # fmt: skip
            return None
        entry = Fenced(session_id, name, peer, Counter(writable))
        self.fenced[entry.holder] = entry
        self._held.update(entry.blocks.keys())
        self.counters.quarantines += 1
        kept = f"{released} committed blocks kept as prefix hits"
        if self.mode == "kill":
            why = self.processes.kill(peer)
            if why is None:
                entry.killed = True
                self.counters.lapsed_killed += 1
                log.warning("%s of %s lapsed: sent it SIGKILL; its %d uncommitted blocks come back once it is gone; %s",
                            who, peer, len(entry.blocks), kept)  # fmt: skip
                return entry.holder
            self.counters.kills_refused += 1
            log.warning("%s of %s lapsed and could not be killed (%s): its %d uncommitted blocks are quarantined "
                        "until it exits; %s", who, peer, why, len(entry.blocks), kept)  # fmt: skip
            return entry.holder
        log.warning("%s of %s lapsed: its %d uncommitted blocks are quarantined until it exits (stop it, or run "
                    "the pool with --lapsed-sessions kill); %s", who, peer, len(entry.blocks), kept)  # fmt: skip
        return entry.holder

    def gone(self) -> list[Fenced]:
        """The entries whose process is gone, taken out of the quarantine: their holders' refs may be released."""
        alive = {peer: self.processes.alive(peer) for peer in {e.peer for e in self.fenced.values()}}  # one look each
        done = [entry for entry in self.fenced.values() if not alive[entry.peer]]
        for entry in done:
            del self.fenced[entry.holder]
            self._held.subtract(entry.blocks.keys())
            for block in entry.blocks:
                if not self._held[block]:
                    del self._held[block]
            self.counters.quarantines_released += 1
            self.counters.blocks_released += len(entry.blocks)
            log.info("%s of session %s (%r) is gone: its %d quarantined blocks are released",
                     entry.peer, entry.session_id, entry.name, len(entry.blocks))  # fmt: skip
        return done

    def stats(self) -> dict[str, int]:
        c = self.counters
        return {
            "blocks": self.num_blocks,
            "processes": len({e.peer for e in self.fenced.values()}),
            "quarantines": c.quarantines,
            "released": c.quarantines_released,
            "blocks_released": c.blocks_released,
            "killed": c.lapsed_killed,
            "kills_refused": c.kills_refused,
        }

    def check(self, refs_of: Callable[[str], Mapping[int, int]]) -> None:
        """Assert the invariants of the module's docstring against the allocator's ``refs_of``."""
        union: Counter[int] = Counter()
        for holder, entry in self.fenced.items():
            assert holder == entry.holder, f"entry {entry.session_id} filed under {holder}"
            assert dict(refs_of(holder)) == dict(entry.blocks), f"{holder}: its refs are not its fenced blocks"
            union.update(entry.blocks.keys())
        assert union == self._held, "the count of held blocks is not the entries' union"
