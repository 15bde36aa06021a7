"""Framing of the fast channel (see ``server/fastpath.py``) and its blocking client connection."""

from __future__ import annotations

import socket
import struct

HEADER = struct.Struct("<I")


def frame(head: bytes, body: bytes) -> bytes:
    """``len || head \\n body``: head is an op name in requests and a status code in replies."""
    payload = b"%s\n%s" % (head, body)
    return HEADER.pack(len(payload)) + payload


class FastConnection:
    """One kept-open Unix-socket connection; one call in flight at a time (use one per thread)."""

    def __init__(self, path: str, timeout_s: float | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(path)

    def call(self, op: bytes, body: bytes) -> tuple[int, bytes]:
        self.sock.sendall(frame(op, body))
        (size,) = HEADER.unpack(self._recv(HEADER.size))
        status, _, reply = self._recv(size).partition(b"\n")
        return int(status), reply

    def _recv(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("the pool closed the fast channel")
            got += k
        return bytes(buf)

    def close(self) -> None:
        self.sock.close()
