"""Where a pool listens by default, so that ``kvpool serve`` and its clients agree without being told."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

DEFAULT_PORT = 8470


def default_socket() -> Path:
    """``$XDG_RUNTIME_DIR/kvpool/kvpool.sock`` where the session manager gives this user a private runtime
    directory, else ``<tmp>/kvpool-<uid>/kvpool.sock`` (a shared directory, where a squatter may come first:
    both pool and clients check who owns what they find there, see :mod:`kvpool.trust`)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isabs(runtime) and os.path.isdir(runtime):
        return Path(runtime) / "kvpool" / "kvpool.sock"
    return Path(tempfile.gettempdir()) / f"kvpool-{os.getuid()}" / "kvpool.sock"


def default_url() -> str:
    return os.environ.get("KVPOOL_URL") or f"unix://{default_socket()}"
