"""Names held under a key or pinned to a user: who may open a session under which name.

A name is how producers address handoffs, and any token holder may open a session under any name, so a name opened
with a key opens again only with that key and from the share that keyed it, also after its sessions ended; an
operator's pin (``--names``) holds a name for one Unix user from the pool's first moment.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict

from kvpool.errors import NameTaken
from kvpool.server.books.processes import Peer
from kvpool.server.books.records import NAMES_KEPT


class NameKeys:
    """The keyed names (the last ``NAMES_KEPT`` of each share, apart) and the operator's pins. ``live``: the names
    that live sessions hold now (the pool's index, read here): such a name is never forgotten."""

    def __init__(self, pins: dict[str, int], live: dict[str, dict[str, None]]) -> None:
        self.pins = pins
        self.live = live
        self.keys: dict[str, tuple[bytes, str | None]] = {}  # name -> its key's digest, the share that keyed it
        self.of: dict[str | None, OrderedDict[str, None]] = {}  # share -> the names it keyed, least recent first

    def check(self, name: str, name_key: str | None, peer: Peer | None) -> bytes | None:
        """The digest of ``name_key``, after checking that ``peer`` may open ``name`` with it (NameTaken if not)."""
        pinned = self.pinned(name)
        if pinned is not None and (peer is None or peer.address is not None or peer.uid != pinned):
            raise NameTaken(
                f"the name {name!r} is pinned to uid {pinned} by the pool's operator (--names, KVPOOL_NAMES): open "
                "it from that user's processes over the pool's Unix socket, or use another name"
            )
        digest = None if name_key is None else hashlib.blake2b(name_key.encode(), digest_size=32).digest()
        held, owner = self.keys.get(name, (None, None))
        share = peer.share if peer is not None else None
        if held is not None and owner is not None and share != owner:
            raise NameTaken(
                f"the name {name!r} is held under a name key by another peer ({owner}): open it from that peer's "
                "processes, or under another name (an operator pins names to users with --names)"
            )
        if held is not None and (digest is None or not hmac.compare_digest(held, digest)):
            raise NameTaken(
                f"the name {name!r} is held under a name key, and this session gave "
                f"{'another' if digest is not None else 'none'}: open it with the key of the worker it belongs to "
                "(PoolClient name_key=, KVPOOL_NAME_KEY), or under another name"
            )
        return digest

    def pinned(self, name: str) -> int | None:
        """The uid the operator pinned ``name`` to, if any (a pin ending in ``*`` covers every name it starts)."""
        pin = self.pins.get(name)
        if pin is not None or not self.pins:
            return pin
        return next((uid for n, uid in self.pins.items() if n.endswith("*") and name.startswith(n[:-1])), None)

    def keep(self, name: str, digest: bytes, share: str | None) -> None:
        """Remember ``name``'s key, as the share that keyed it first; past ``NAMES_KEPT`` names of that share,
        forget its least recently opened name that no session holds."""
        owner = self.keys.get(name, (b"", share))[1]
        self.keys[name] = (digest, owner)
        names = self.of.setdefault(owner, OrderedDict())
        names[name] = None
        names.move_to_end(name)
        if len(names) <= NAMES_KEPT:
            return
        for old in names:
            if old not in self.live:
                del names[old], self.keys[old]
                return
