"""File descriptors over the fast channel's Unix socket (SCM_RIGHTS), beside its ordinary frames.

The kernel duplicates a passed fd into the receiving process: the receiver holds the object itself, and nobody
who merely learns a number or a name can. That is what makes a VMM arena's fd safer than a legacy IPC handle,
which is 64 bytes anyone can copy. asyncio's streams carry no ancillary data, so the pool sends the one reply
that carries an fd itself, on a duplicate of the connection's socket, once the stream's own queue is empty.
"""

from __future__ import annotations

import asyncio
import os
import socket

from kvpool.channel import HEADER

#: how long a reply waits for the bytes queued before it (a client that stopped reading) before giving up
QUEUE_WAIT_S = 5.0


async def send_with_fd(writer: asyncio.StreamWriter, data: bytes, fd: int) -> None:
    """Write ``data`` with ``fd`` attached to its first byte, after everything already queued on ``writer``."""
    await writer.drain()
    transport = writer.transport
    loop = asyncio.get_running_loop()
    deadline = loop.time() + QUEUE_WAIT_S
    while transport.get_write_buffer_size():
        if loop.time() > deadline:
            raise ConnectionError("the client does not read its replies")
        await asyncio.sleep(0.001)
    raw = writer.get_extra_info("socket")
    dup = socket.socket(fileno=os.dup(raw.fileno()))
    try:
        while True:
            try:
                sent = socket.send_fds(dup, [data], [fd])
                break
            except BlockingIOError:  # the shared description is non-blocking: wait for room, as a stream would
                if loop.time() > deadline:
                    raise ConnectionError("the client does not read its replies") from None
                await asyncio.sleep(0.001)
    finally:
        dup.close()
    if sent < len(data):
        writer.write(data[sent:])


def recv_frame_with_fd(sock: socket.socket) -> tuple[bytes, int | None]:
    """Read one frame's payload from a blocking socket, and the fd that came with it, if any."""
    fds: list[int] = []
    try:
        buf = b""
        while len(buf) < HEADER.size:
            data, got, _flags, _addr = socket.recv_fds(sock, 1 << 16, 4)
            fds.extend(got)
            if not data:
                raise ConnectionError("the pool closed the fast channel")
            buf += data
        (size,) = HEADER.unpack(buf[: HEADER.size])
        while len(buf) < HEADER.size + size:
            data = sock.recv(HEADER.size + size - len(buf))
            if not data:
                raise ConnectionError("the pool closed the fast channel")
            buf += data
        if len(buf) > HEADER.size + size or len(fds) > 1:
            raise ConnectionError("the pool sent more than one reply and one fd: the fast channel is out of step")
    except BaseException:  # a time-out or an interruption half way, too: an fd that came is not leaked
        _close(fds)
        raise
    return buf[HEADER.size :], fds[0] if fds else None


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
