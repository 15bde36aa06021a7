"""Which process is at the other end of a Unix socket, whether it still lives, and how the pool ends it.

The pool fences a lapsed session's blocks until the process that held them is gone (:mod:`kvpool.server.quarantine`),
so it must name that process in a way a later one cannot take over: a pid alone is reused once the process is
reaped, so a peer is its pid with its start time (``/proc/<pid>/stat`` field 22, clock ticks since boot), and a
process at that pid with another start time is another process. Only a Unix socket tells who is at the other end
(``SO_PEERCRED``, from the kernel, which no client can forge); a TCP peer stays unknown.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
from dataclasses import dataclass
from typing import Any, Protocol

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


@dataclass(frozen=True, slots=True)
class Peer:
    """A process that reached the pool over a Unix socket."""

    pid: int
    uid: int
    gid: int
    start: int  # its start time, in clock ticks since boot: with the pid, a name no later process has

    def __str__(self) -> str:
        return f"pid {self.pid} (uid {self.uid})"


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


def peer_of(sock: Any) -> Peer | None:
    """The process at the other end of a Unix socket (a socket, or asyncio's view of one; None for TCP, or a peer
    already gone). The pool's own process
    (a client in the pool's process: tests, an embedded pool) is none either: it is never fenced from itself."""
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError:
        return None
    if pid <= 0 or pid == os.getpid():
        return None
    start = start_time(pid)
    return Peer(pid, uid, gid, start) if start is not None else None


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
        return start_time(peer.pid) == peer.start

    def kill(self, peer: Peer) -> str | None:
        """SIGKILL through a pidfd, opened and then checked to name ``peer``: the signal reaches that process or
        none, even if the pid was reused in between."""
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
