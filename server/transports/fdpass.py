"""The pool's side of file descriptors over the fast channel's Unix socket (SCM_RIGHTS), beside its ordinary frames.

The kernel duplicates a passed fd into the receiving process: the receiver holds the object itself, and nobody
who merely learns a number or a name can. That is what makes a VMM arena's fd safer than a legacy IPC handle,
which is 64 bytes anyone can copy. asyncio's streams carry no ancillary data, so the pool sends the one reply
that carries an fd itself, on a duplicate of the connection's socket, once the stream's own queue is empty. A
client reads it with :func:`kvpool.channel.recv_frame_with_fd`.
"""

from __future__ import annotations

import asyncio
import os
import socket

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
