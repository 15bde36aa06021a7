"""The KV-event publisher: a ZeroMQ PUB socket and a ROUTER replay socket, served from a thread of their own.

It speaks vLLM's protocol (``ZmqEventPublisher``): each batch goes out as three frames ``[topic, seq, payload]``,
``seq`` an 8-byte big-endian counter that starts at 0 with each pool process, ``payload`` the msgpack batch
(:mod:`kvpool.server.events.kvevents`). The last ``buffer_steps`` batches are kept: a subscriber that sees a gap in
``seq`` sends the first sequence number it missed (8 bytes, big-endian) to the replay socket and gets back every
kept batch from there, as ``[b"", topic, seq, payload]`` each, then ``[b"", b"", -1 (8 bytes, signed), b""]``.

The PUB socket binds its address, or connects to a subscriber that binds one (llm-d's central indexer does);
the replay socket always binds. The pool's event loop only puts raw events on a bounded queue and never waits:
encoding and sending happen on the thread. A full queue drops the event and counts it (``kvpool_kv_events_dropped``):
a router's view of the pool is stale from then on until the pool restarts, so size the queue for bursts
(``--kv-events-queue-size``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

import msgspec
import zmq

from kvpool.errors import InvalidRequest
from kvpool.server.events.kvevents import EventForm, HashForm, RawEvent, encode_batch, encode_event

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: events one batch carries at most; a burst goes out as several batches
MAX_BATCH_EVENTS = 256
POLL_S = 0.05
LINGER_MS = 500


def binds(endpoint: str, mode: str) -> bool:
    """Whether the PUB socket binds ``endpoint`` or connects to it; ``auto`` is vLLM's rule."""
    if mode != "auto":
        return mode == "bind"
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EventPublisher:
    """Publishes raw events (:meth:`put`, from the event loop) as vLLM-format batches, from its own thread."""

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        queue_size: int = 100_000,
        hwm: int = 100_000,
        hashes: HashForm = "int",
        form: EventForm = "map",
        mode: str = "bind",
    ) -> None:
        self.topic = topic.encode()
        self.hashes, self.form = hashes, form
        self._queue: deque[tuple[int, RawEvent]] = deque()  # appends and pops are atomic: no lock on the loop
        self._queue_size = queue_size
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            self._pub.setsockopt(zmq.LINGER, LINGER_MS)
            self.endpoint = self._open(self._pub, endpoint, "--kv-events-endpoint", binds(endpoint, mode))
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 1)  # one whole replay per peer, no more
                self.replay_endpoint = self._open(self._replay, replay_endpoint, "--kv-events-replay-endpoint")
        except BaseException:
            self._close_sockets()
            raise
        self.next_seq = 0
        self.batches = 0
        self.accepted = 0
        self.events = 0
        self.dropped = 0  # by the event loop (the queue was full)
        self.failed = 0  # by the thread (a batch could not be sent)
        self.replay_requests = 0
        self._dropping = False
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(sock: zmq.Socket[bytes], endpoint: str, flag: str, bind: bool = True) -> str:
        """Bind (the address actually bound, a ``:*`` port resolved) or connect ``sock``, or say what to fix."""
        try:
            if not bind:
                sock.connect(endpoint)
                return endpoint
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            how, fix = ("bind", "pick a free address") if bind else ("connect", "check the address")
            raise InvalidRequest(f"cannot {how} {flag} {endpoint!r}: {exc}: {fix}") from None
        return str(sock.getsockopt_string(zmq.LAST_ENDPOINT))

    # -- the event loop's side --------------------------------------------------------------------------

    def put(self, rank: int, event: RawEvent) -> None:
        """Queue one event for data-parallel rank ``rank``; never blocks (a full queue drops it, counted)."""
        if len(self._queue) >= self._queue_size:
            self.dropped += 1
            if not self._dropping:
                log.warning("KV events queue full (%d): events are dropped, routers' view of this pool is stale; "
                            "raise --kv-events-queue-size", self._queue_size)  # fmt: skip
            self._dropping = True
            return
        self._queue.append((rank, event))
        self.accepted += 1
        self._dropping = False
        if not self._wake.is_set():
            self._wake.set()

    def stats(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "next_seq": self.next_seq,
            "batches": self.batches,
            "published": self.events,
            "dropped": self.dropped + self.failed,
            "pending": self.accepted - self.events - self.failed,  # queued, or taken by the thread and not yet sent
            "replay_requests": self.replay_requests,
        }

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then close the sockets."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("KV events publisher did not drain in %.1fs: %d events unsent", timeout_s, len(self._queue))
            return  # the thread still uses the sockets; the process is ending anyway
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()

    # -- the thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        pending = self._queue
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    try:
                        self._serve_replay()
                    except Exception:
                        log.exception("KV events replay failed")
            if not pending:
                if self._stop.is_set():
                    return
                self._wake.wait(POLL_S)
                self._wake.clear()  # the queue is looked at again before the next wait
                continue
            items = []
            while pending and len(items) < MAX_BATCH_EVENTS:
                items.append(pending.popleft())
            start = 0
            for i in range(1, len(items) + 1):  # one batch per run of events of one rank
                if i == len(items) or items[i][0] != items[start][0]:
                    try:
                        self._send(encoder, items[start][0], [raw for _, raw in items[start:i]])
                    except Exception:
                        self.failed += i - start
                        log.exception("KV events batch could not be sent")
                    start = i

    def _send(self, encoder: msgspec.msgpack.Encoder, rank: int, raws: list[RawEvent]) -> None:
        events = [encode_event(raw, self.hashes, self.form) for raw in raws]
        payload = encoder.encode(encode_batch(events, rank))
        seq = self.next_seq
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.next_seq = seq + 1
        self.batches += 1
        self.events += len(raws)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignored a KV events replay request of %d frames (send [b'', start seq])", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.replay_requests += 1
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
