"""A peer's turns: at most ``cap`` at once, handed on first come, first served; who a peer is."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

from kvpool.server.transports.turns import MAX_GAP_S, MIN_GAP_S, Turns, peer_key


class Conn:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def granted(self) -> None:
        self.log.append(self.name)


def test_turns_are_capped_and_handed_on_in_order() -> None:
    async def scenario() -> list[str]:
        log: list[str] = []
        turns = Turns(2)
        peer = turns.join("loopback")
        a, b, c, d = (Conn(n, log) for n in "abcd")
        assert peer.take(a) and peer.take(b)
        assert not peer.take(c) and not peer.take(d) and not peer.take(c)  # queued once
        peer.forget(d)
        peer.give()
        peer.give()
        await asyncio.sleep(5 * MIN_GAP_S)  # its timer (MIN_GAP_S) comes first
        assert peer.taken == 1  # c has one, handed over; the other came back
        peer.give()
        turns.leave("loopback", peer)
        assert turns.peers == {}
        return log

    assert asyncio.run(scenario()) == ["c"]


def test_a_turn_handed_on_waits_as_long_as_it_was_held_and_a_millisecond_at_least() -> None:
    """A flood of cheap token-less requests (a ``/health`` answered at the door) got a turn every few tens of
    microseconds, 7,500 answers a second and most of a core, and the token holders waited for the CPU: the gap
    between two of a peer's requests has a floor, so they come 1,000 a second at most."""

    async def scenario() -> list[float]:
        gaps: list[float] = []
        loop = asyncio.get_running_loop()
        loop.call_later = lambda delay, callback, *args: gaps.append(delay)  # type: ignore[method-assign, assignment]
        peer = Turns(1).join("loopback")
        assert peer.take(Conn("a", []))
        for held in (0.00003, 0.004, 1.0):
            assert not peer.take(Conn("b", []))
            peer.give(held)
        return gaps

    assert asyncio.run(scenario()) == [MIN_GAP_S, 0.004, MAX_GAP_S]


class FakeTransport:
    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info

    def get_extra_info(self, name: str) -> Any:
        return self.info.get(name)


def test_every_loopback_address_is_one_peer_and_a_unix_peer_is_its_user() -> None:
    tcp = socket.socket()
    try:
        for host in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.9"):
            assert peer_key(FakeTransport({"socket": tcp, "peername": (host, 5)})) == "loopback"
        assert peer_key(FakeTransport({"socket": tcp, "peername": ("10.1.2.3", 5)})) == "10.1.2.3"
    finally:
        tcp.close()
    left, right = socket.socketpair(socket.AF_UNIX)
    try:
        assert peer_key(FakeTransport({"socket": left})) == f"uid {os.getuid()}"
    finally:
        left.close()
        right.close()
