"""Reservation slabs: a session's blocks allocated and freed in its own process, and handed to other slab sessions
with no round trip (``kvpool serve --slabs``). ``SlabClient`` is the client that keeps one; ``SlabConfig`` sizes it."""

from kvpool.slab.client import SlabClient
from kvpool.slab.reservation import SlabConfig

__all__ = ["SlabClient", "SlabConfig"]
