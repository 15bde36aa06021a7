"""Fixtures of the server's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.server.config import PoolSettings
from kvpool.server.plane import ControlPlane


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[ControlPlane]:
    """A started control plane on a small CPU arena, with the token ``s3cret`` (for the fast channel's tests)."""
    settings = PoolSettings(
        backend="cpu", num_blocks=8, block_size=4, num_layers=1, num_kv_heads=1, head_dim=8,
        socket=tmp_path / "kvpool.sock", port=0, shm_dir=tmp_path / "shm", token="s3cret",
    )  # fmt: skip
    p = ControlPlane(settings)
    p.start()
    yield p
    p.close()
