"""Where a pool listens by default, so that ``kvpool serve`` and its clients agree without being told."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

DEFAULT_PORT = 8470


def default_socket() -> Path:
    return Path(tempfile.gettempdir()) / f"kvpool-{os.getuid()}" / "kvpool.sock"


def default_url() -> str:
    return os.environ.get("KVPOOL_URL") or f"unix://{default_socket()}"
