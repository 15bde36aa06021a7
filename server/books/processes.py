"""Who is at the other end of a connection: which process (on a Unix socket), whether it still lives, how the pool
ends it, and whose share of the pool's per-peer bounds its sessions take.

The pool fences a lapsed session's blocks until the process that held them is gone
(:mod:`kvpool.server.books.quarantine`),
so it must name that process in a way a later one cannot take over: a pid alone is reused once the process is
reaped, so a peer is its pid with its start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), and a
process at that pid with another start time is another process. Only a Unix socket tells who is at the other end
(``SO_PEERCRED``, from the kernel, which no client can forge); a TCP peer's process stays unknown.

The same peer is what the pool bounds one client by (sessions, parked handoffs, keyed names, parse turns): a token
holder may open any number of sessions, so a bound per session alone lets one client take a pool-wide budget from
everyone. Its share is its user on a Unix socket, its address on TCP, every loopback address counting as one (any
local user can send from 127.0.0.2 as well as from 127.0.0.1: the Unix socket is what tells local users apart).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import struct
from dataclasses import dataclass
from typing import Any, Protocol

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True, slots=True)
class Peer:
    """Who reached the pool: over a Unix socket a process of a user, over TCP an address."""

    pid: int | None  # None: no process the pool may watch (TCP, or the pool's own process)
    uid: int | None
    gid: int | None
    start: int | None  # its start time, in clock ticks since boot: with the pid, a name no later process has
    address: str | None = None  # a TCP peer's address, every loopback one as ``loopback``

    @classmethod
    def tcp(cls, address: str) -> Peer:
        return cls(None, None, None, None, address)

    @property
    def process(self) -> bool:
        """Whether it names a process, which the quarantine can watch and end."""
        return self.pid is not None and self.start is not None

    @property
    def share(self) -> str:
        """Whose share of the per-peer bounds it takes: ``uid N`` on a Unix socket, else its TCP address."""
        return self.address if self.address is not None else f"uid {self.uid}"

    def __str__(self) -> str:
        if self.process:
            return f"pid {self.pid} (uid {self.uid})"
        return f"TCP {self.address}" if self.address is not None else f"uid {self.uid}"


def start_time(pid: int) -> int | None:
    """The start time of the process ``pid``, or None where there is none or it is dead (a zombie: it holds no
    memory and runs no code any more, so its blocks are safe to give out, whether or not its parent reaped it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()  # after the command name, which may hold spaces and parens
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])  # field 22 of the whole line: the 20th after the name's


def address_of(host: str) -> str:
    """A TCP peer's address as its share: every loopback address (and an IPv4 one mapped into IPv6) as one."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return "loopback" if addr.is_loopback else str(addr)


def peer_of(sock: Any, peername: Any = None) -> Peer | None:
    """Who is at the other end of a socket (a socket, or asyncio's view of one, with its ``peername``): on TCP its
    address; on a Unix socket its user and process, the process none where it is gone already or is the pool's own
    (a client in the pool's process: tests, an embedded pool), which is never fenced from itself. None where
    nothing is known."""
    if sock is None:
        return None
    if sock.family != socket.AF_UNIX:
        host = peername[0] if isinstance(peername, tuple) and peername else None
        return Peer.tcp(address_of(str(host))) if host is not None else None
    try:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    start = start_time(pid) if pid > 0 and pid != os.getpid() else None
    return Peer(pid if start is not None else None, uid, gid, start)


class Processes(Protocol):
    """The process table as the quarantine needs it (a fake in tests)."""

    def alive(self, peer: Peer) -> bool:
        """Whether ``peer`` still runs (the same pid with the same start time)."""
        ...

    def kill(self, peer: Peer) -> str | None:
        """Send ``peer`` SIGKILL; None once sent (or it is gone already), else why it could not be."""
        ...


class ProcTable:
    """The host's processes, through ``/proc`` and pidfds."""

    def alive(self, peer: Peer) -> bool:
        return peer.pid is not None and start_time(peer.pid) == peer.start

    def kill(self, peer: Peer) -> str | None:
        """SIGKILL through a pidfd, opened and then checked to name ``peer``: the signal reaches that process or
        none, even if the pid was reused in between."""
        if peer.pid is None:
            return "no process is known"
        try:
            fd = os.pidfd_open(peer.pid)
        except ProcessLookupError:
            return None
        except OSError as exc:
            return f"pidfd_open failed: {exc.strerror}"
        try:
            if start_time(peer.pid) != peer.start:
                return None  # it died, and the pid went to another process
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:
            return None
        except PermissionError:
            return f"the pool (uid {os.getuid()}) may not signal a process of uid {peer.uid}"
        except OSError as exc:
            return f"pidfd_send_signal failed: {exc.strerror}"
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        return None
