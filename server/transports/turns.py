"""Turns: how many requests of one peer the pool reads and answers at once before their token is checked.

The pool has one event loop. Whatever it parses, it holds and answers on that loop, so a peer that may send
requests without the token (``/health``, or anything answered 401) must not be able to queue or run more of them
than a few at once: one ``send`` of thousands of pipelined requests once made the pool hold every one of them,
and a hundred such connections cost a gigabyte and starved the token holders. A connection needs one of its
peer's turns to hand bytes to the HTTP parser; it gives the turn back once its request shows the token, once the
request is answered, while the request waits on its client for the rest of its bytes, and while the client does
not read the answer. A connection waiting for a turn reads nothing more. Waiting connections are served first
come, first served, and a turn handed on waits as long as it was held (10 ms at most), and 1 ms at least: a
peer's flood has the loop half the time at most, and its requests come 1,000 a second at most. The floor is what
bounds a flood of cheap requests: a ``/health`` is answered at the door in tens of microseconds, and the loop's own
work around each (the wake-up, the timer, the write) is not in the time the turn was held, so without it 100
pipelining connections got 7,500 answers a second and most of a core, and the token holders' calls on the Unix
socket waited for the CPU (``kvpool bench flood``: fast-channel p99 up to 5x quiet).

A peer is who sent the bytes as the kernel says: on the Unix socket the user (SO_PEERCRED), on TCP the address,
every loopback address counting as one (any local user can send from 127.0.0.2 as well as from 127.0.0.1).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import Any

from kvpool.server.books.processes import peer_of

#: the longest a turn waits between two requests of a peer, however long the first was held
MAX_GAP_S = 0.01
#: the shortest: a peer's requests without the token come this often at most
MIN_GAP_S = 0.001


class Peer:
    """One peer's turns: at most ``cap`` taken at once, the others waiting in order of asking."""

    __slots__ = ("cap", "connections", "taken", "waiting")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.taken = 0
        self.connections = 0
        self.waiting: deque[Any] = deque()

    def take(self, waiter: Any) -> bool:
        """A turn now (True), or ``waiter`` is queued and its ``granted`` is called once one is free."""
        if self.taken < self.cap and not self.waiting:
            self.taken += 1
            return True
        if waiter not in self.waiting:
            self.waiting.append(waiter)
        return False

    def give(self, held_s: float = 0.0) -> None:
        """A turn back, after ``held_s`` of the loop's time: handed on to the first waiter, if any (it keeps the
        count), as long again later (:data:`MIN_GAP_S` at least), so that a peer whose requests queue up has the
        loop half the time at most, and no more than 1,000 of them a second."""
        if self.waiting:
            asyncio.get_running_loop().call_later(
                min(max(held_s, MIN_GAP_S), MAX_GAP_S), self.waiting.popleft().granted
            )
        else:
            self.taken -= 1

    def forget(self, waiter: Any) -> None:
        """``waiter`` is gone: it waits no more."""
        with contextlib.suppress(ValueError):
            self.waiting.remove(waiter)


class Turns:
    """Every peer's turns, ``cap`` each; a peer is forgotten when its last connection closes."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.peers: dict[str, Peer] = {}

    def join(self, key: str) -> Peer:
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = Peer(self.cap)
        peer.connections += 1
        return peer

    def leave(self, key: str, peer: Peer) -> None:
        peer.connections -= 1
        if peer.connections <= 0 and peer.taken == 0 and not peer.waiting:
            self.peers.pop(key, None)


def peer_key(transport: asyncio.BaseTransport) -> str:
    """Who is on the other end, as the kernel says: its share (:attr:`kvpool.server.books.processes.Peer.share`)."""
    peer = peer_of(transport.get_extra_info("socket"), transport.get_extra_info("peername"))
    return peer.share if peer is not None else "unknown"
