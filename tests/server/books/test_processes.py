"""Peers of Unix sockets, named by pid and start time, and how the pool ends one."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.server.books.processes import Peer, ProcTable, peer_of, start_time

#: connects to the Unix socket at argv[1] and waits
CONNECT = "import socket, sys, time; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); time.sleep(600)"


@pytest.fixture
def child(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], socket.socket]]:
    """A child process connected to a listener of ours, and our end of its connection."""
    path = str(tmp_path / "peer.sock")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(path)
        listener.listen(1)
        proc = subprocess.Popen([sys.executable, "-c", CONNECT, path])
        conn, _ = listener.accept()
    yield proc, conn
    conn.close()
    proc.kill()
    proc.wait()


def test_a_unix_peer_is_its_pid_uid_and_start_time(child) -> None:
    proc, conn = child
    peer = peer_of(conn)
    assert peer == Peer(proc.pid, os.getuid(), os.getgid(), start_time(proc.pid))
    assert ProcTable().alive(peer)
    assert not ProcTable().alive(Peer(proc.pid, peer.uid, peer.gid, peer.start + 1))  # a reused pid is another


def test_no_process_over_tcp_nor_for_the_pool_s_own_process_but_a_share_for_each() -> None:
    a, b = socket.socketpair()
    with a, b, socket.socket() as tcp:
        own = peer_of(a)
        assert own == Peer(None, os.getuid(), os.getgid(), None) and not own.process
        assert own.share == f"uid {os.getuid()}" and not ProcTable().alive(own)
        for host in ("127.0.0.1", "127.0.0.2", "::1", "::ffff:127.0.0.1"):
            assert peer_of(tcp, (host, 5)) == Peer.tcp("loopback")
        remote = peer_of(tcp, ("10.1.2.3", 5))
        assert remote is not None and remote.share == "10.1.2.3" and not remote.process
        assert peer_of(tcp) is None and peer_of(None) is None


def test_kill_ends_the_peer_and_it_is_gone_once_dead(child) -> None:
    proc, conn = child
    peer = peer_of(conn)
    assert peer is not None
    assert ProcTable().kill(peer) is None
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert not ProcTable().alive(peer) and ProcTable().kill(peer) is None
