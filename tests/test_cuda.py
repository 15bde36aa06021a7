"""The IPC handle's 64 bytes survive the ctypes round trip, zero bytes included (no GPU needed)."""

from __future__ import annotations

import pytest

from kvpool.cuda import IPC_HANDLE_BYTES, CudaError, IpcMemHandle


def test_handle_bytes_round_trip_through_the_struct_with_zero_bytes():
    raw = bytes([7, 0, 0, 3, *range(60)])
    assert len(raw) == IPC_HANDLE_BYTES
    assert IpcMemHandle.from_bytes(raw).to_bytes() == raw


def test_a_handle_of_the_wrong_size_is_refused():
    with pytest.raises(CudaError, match="64 bytes, got 6"):
        IpcMemHandle.from_bytes(b"\x01" * 6)
