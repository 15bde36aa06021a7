"""How a client maps the pool's arena: once per process and device, checked against the model's layout.

For a VMM arena the descriptor and the fd come in one fast-channel exchange (a ``GET /arena`` first would cost as
much as the mapping itself); the fd only ever travels over the pool's Unix socket, to a live session.
"""

from __future__ import annotations

import os

from kvpool.arena import Arena, FetchedFd, open_arena, prepare_vmm
from kvpool.errors import InvalidRequest, PoolRestarted
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor, ArenaFdRequest, ArenaFdResponse
from kvpool.routes import ARENA, ARENA_FD
from kvpool.session import Session
from kvpool.transport import Transport


class ArenaMapper:
    """A client's mapped arenas, by device. ``fd_path`` is the fast channel's socket where the session's opening
    said the arena goes by fd, else None."""

    def __init__(self, transport: Transport, session: Session, arenas: dict[int | None, Arena]) -> None:
        self.transport = transport
        self.session = session
        self.arenas = arenas
        self.fd_path: str | None = None

    def descriptor(self) -> ArenaDescriptor:
        descriptor: ArenaDescriptor = self.transport.fetch(ARENA)
        return descriptor

    def arena(self, layout: KVLayout | None, check: KVLayout | None, device: int | None) -> Arena:
        """The arena mapped with ``layout``; one mapped already is checked against ``check`` instead, if given."""
        if isinstance(self.session.lost, PoolRestarted):
            raise self.session.lost
        arena = self.arenas.get(device)
        if arena is None or arena.closed:
            descriptor, fd = self._descriptor_with_fd(device)
            source = FetchedFd(fd, device, lambda d: self.arena_fd(descriptor, d))
            try:
                if descriptor.epoch != self.session.epoch:  # a restart not noticed yet: never map it for an old session
                    self.session.restarted(descriptor.epoch)
                arena = self.arenas[device] = open_arena(descriptor, layout, device, source)
            finally:
                source.close()
        elif check is not None:
            open_arena(arena.descriptor, check)
        return arena

    def _descriptor_with_fd(self, device: int | None) -> tuple[ArenaDescriptor, int | None]:
        path = self.fd_path
        if path is not None:
            req = ArenaFdRequest(session_id=self.session.session_id, device=device)
            try:  # a restarted pool refuses the session: guard() raises PoolRestarted then, as GET /arena would
                reply, fd = self.session.guard(lambda: self.transport.fetch_fd(ARENA_FD, req, path, prepare_vmm))
            except InvalidRequest:  # that device's arena goes by handle
                return self.descriptor(), None
            try:
                descriptor = ArenaFdResponse.model_validate_json(reply).descriptor
            except BaseException:
                os.close(fd)
                raise
            if descriptor is not None:
                return descriptor, fd
            os.close(fd)
        return self.descriptor(), None

    def arena_fd(self, descriptor: ArenaDescriptor, device: int | None) -> int:
        """A VMM arena's fd, from the pool's fast channel: never over TCP or HTTP, and only for this session."""
        path = descriptor.fast_socket
        if not path or not os.path.exists(path):
            raise InvalidRequest(
                f"the pool's arena is a VMM allocation handed over its Unix socket ({path or 'none'}), which this "
                "process cannot reach: run beside the pool with its socket directory mounted, or start the pool "
                "with --arena-handle legacy"
            )
        req = ArenaFdRequest(session_id=self.session.session_id, device=device)
        return self.transport.call_fd(ARENA_FD, req, path)
