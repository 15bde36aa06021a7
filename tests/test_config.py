"""Settings: defaults that run on a laptop, KVPOOL_* variables, flags over variables, clear refusals."""

from __future__ import annotations

import argparse

import pytest
from kvpool.server.config import PoolSettings, add_settings_arguments, parse_size, settings_from_args
from pydantic import ValidationError


def parse(argv: list[str]) -> PoolSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, PoolSettings)
    return settings_from_args(parser.parse_args(argv))


def test_defaults_bind_loopback_and_a_private_socket():
    s = PoolSettings()
    assert (s.host, s.port, s.backend) == ("127.0.0.1", 8470, "auto")
    assert s.socket is not None and s.socket_mode == 0o660
    assert s.layout.block_nbytes == 2 * 4 * 16 * 4 * 64 * 2


def test_flags_override_environment(monkeypatch):
    monkeypatch.setenv("KVPOOL_NUM_BLOCKS", "100")
    monkeypatch.setenv("KVPOOL_DTYPE", "bf16")
    monkeypatch.setenv("KVPOOL_TOKEN", "s3cret")
    s = parse(["--num-blocks", "7", "--socket-mode", "600", "--no-fast-channel"])
    assert (s.num_blocks, s.dtype, s.socket_mode, s.fast_socket) == (7, "bfloat16", 0o600, None)
    assert s.token is not None and s.token.get_secret_value() == "s3cret"
    assert "s3cret" not in repr(s)


@pytest.mark.parametrize(
    "argv",
    [["--num-blocks", "4", "--arena-bytes", "1GiB"], ["--dtype", "int8"], ["--port", "0", "--socket", "none"]],
)
def test_contradictions_are_refused(argv):
    with pytest.raises(ValidationError):
        parse(argv)


def test_sizes_read_like_people_write_them():
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("1.5G") == 1_500_000_000
    assert parse(["--arena-bytes", "2MiB"]).arena_bytes == 2 << 20
    with pytest.raises(ValueError, match="as a size"):
        parse_size("lots")
