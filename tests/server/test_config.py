"""Settings: defaults that run on a laptop, KVPOOL_* variables, flags over variables, clear refusals."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from kvpool.server.config import PoolSettings, add_settings_arguments, describe_error, parse_size, settings_from_args


def parse(argv: list[str]) -> PoolSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, PoolSettings)
    return settings_from_args(parser.parse_args(argv))


def test_defaults_bind_loopback_and_a_private_socket():
    s = PoolSettings()
    assert (s.host, s.port, s.backend) == ("127.0.0.1", 8470, "auto")
    assert s.socket is not None and s.socket_mode == 0o660
    assert s.layout.block_nbytes == 2 * 4 * 16 * 2 * 32 * 2


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
    [
        ["--num-blocks", "4", "--arena-bytes", "1GiB"],
        ["--port", "0", "--socket", "none"],
        ["--max-fast-buffer-bytes", "1MiB"],  # under --max-body-bytes: the largest frame could never be read
        ["--read-timeout-s", "0"],
        ["--max-http-connections", "0"],
        ["--peers", "http://10.0.0.2:8470"],  # without --token: peers present it to each other
        ["--peers", "10.0.0.2:8470", "--token", "t"],  # a peer is a URL
    ],
)
def test_contradictions_are_refused(argv):
    with pytest.raises(ValidationError):
        parse(argv)


def test_connection_bounds_are_settings(monkeypatch):
    assert (PoolSettings().read_timeout_s, PoolSettings().max_http_connections) == (10.0, 1024)
    monkeypatch.setenv("KVPOOL_READ_TIMEOUT_S", "2.5")
    s = parse(["--max-http-connections", "50", "--max-fast-buffer-bytes", "64MiB"])
    assert (s.read_timeout_s, s.max_http_connections, s.max_fast_buffer_bytes) == (2.5, 50, 64 << 20)


def test_peers_are_a_list_of_urls():
    s = parse(["--peers", " http://10.0.0.2:8470/, https://node-b:8470", "--token", "t"])
    assert s.peer_list == ["http://10.0.0.2:8470", "https://node-b:8470"]
    assert parse([]).peer_list == []


def test_a_pool_with_peers_gives_its_gpu_arenas_legacy_handles_unless_told():
    """NIXL's UCX reads another GPU's VMM memory through the host (0.4 GB/s on two H200s against 303 GB/s for
    cudaMalloc memory): ``auto`` picks what peers can read fast; an explicit choice stands."""
    peers = ["--peers", "http://10.0.0.2:8470", "--token", "t"]
    assert parse(peers).arena_handle_for_peers == "legacy"
    assert parse([]).arena_handle_for_peers == "auto"
    assert parse([*peers, "--arena-handle", "vmm"]).arena_handle_for_peers == "vmm"
    assert parse([*peers, "--backend", "cpu"]).arena_handle_for_peers == "auto"


def test_sizes_read_like_people_write_them():
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("8GiB") == 8 << 30
    assert parse_size("1.5G") == 1_500_000_000
    assert parse(["--arena-bytes", "2MiB"]).arena_bytes == 2 << 20
    with pytest.raises(ValueError, match="as a size"):
        parse_size("lots")


def test_flags_offer_only_the_allowed_values(capsys):
    for flag, value in [("--dtype", "int8"), ("--backend", "rocm"), ("--order", "tiled"), ("--log-level", "loud")]:
        with pytest.raises(SystemExit):
            parse([flag, value])
        assert "invalid choice" in capsys.readouterr().err
    assert parse(["--dtype", "bf16"]).dtype == "bfloat16"


def test_help_gives_every_flag_its_text_default_and_variable():
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, PoolSettings)
    actions = {a.dest: a for a in parser._actions if a.dest in PoolSettings.model_fields}
    assert set(actions) == set(PoolSettings.model_fields)
    for name, action in actions.items():
        text = action.help or ""
        assert not text.startswith("None"), f"--{name} has no description"
        assert "`" not in text, text
        assert text.endswith(f"; KVPOOL_{name.upper()}]") and " [" in text, text
    assert actions["max_body_bytes"].help.endswith("[16.0MiB; KVPOOL_MAX_BODY_BYTES]")
    assert actions["socket_mode"].help.endswith("[660; KVPOOL_SOCKET_MODE]")
    assert actions["backend"].choices == ["auto", "cuda", "cpu"]


def test_help_says_what_the_pool_does_when_no_size_is_given():
    """The arena holds DEFAULT_NUM_BLOCKS blocks when no size is given: the help says so, and so does the pool."""
    from kvpool.layout import KVLayout
    from kvpool.server.arenas import size_in_blocks
    from kvpool.server.config import DEFAULT_NUM_BLOCKS

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, PoolSettings)
    (action,) = [a for a in parser._actions if a.dest == "num_blocks"]
    assert action.help.endswith(f"[{DEFAULT_NUM_BLOCKS} when no size is given; KVPOOL_NUM_BLOCKS]")
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float32")
    got = size_in_blocks(layout, num_blocks=None, arena_bytes=None, gpu_memory_fraction=None, free_device_bytes=None)
    assert got == DEFAULT_NUM_BLOCKS == 1024


def test_serve_help_puts_every_flag_in_one_section():
    from kvpool.server.config import GROUPS

    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(PoolSettings.model_fields), "a field in no section, or in two"
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, PoolSettings, GROUPS)
    sections = {g.title: {a.dest for a in g._group_actions} for g in parser._action_groups}
    for title, names in GROUPS.items():
        assert sections[title] == set(names)
    assert "other" not in sections


def test_a_cuda_only_setting_on_a_cpu_pool_is_said_before_it_starts():
    from kvpool.server.config import backend_problem

    def cuda(present: bool):
        return lambda: present

    fraction = PoolSettings(gpu_memory_fraction=0.5)
    problem = backend_problem(fraction, cuda(False))
    assert problem is not None and problem.startswith("--gpu-memory-fraction (KVPOOL_GPU_MEMORY_FRACTION)")
    assert "--num-blocks N or --arena-bytes SIZE instead" in problem
    assert backend_problem(fraction, cuda(True)) is None
    on_cpu = PoolSettings(backend="cpu", gpu_memory_fraction=0.5)
    assert "(--backend cpu)" in (backend_problem(on_cpu, cuda(True)) or "")
    assert "use --backend cpu" in (backend_problem(PoolSettings(backend="cuda"), cuda(False)) or "")
    for fine in (PoolSettings(), PoolSettings(backend="cpu", num_blocks=8), PoolSettings(arena_bytes="1MiB")):
        assert backend_problem(fine, cuda(False)) is None


def test_invalid_settings_are_one_line_naming_flag_and_variable():
    with pytest.raises(ValidationError) as exc:
        parse(["--num-blocks", "0", "--max-body-bytes", "lots"])
    line = describe_error(exc.value)
    assert "\n" not in line and "pydantic" not in line and "http" not in line
    assert "--num-blocks (KVPOOL_NUM_BLOCKS): Input should be greater than or equal to 1, got '0'" in line
    assert "--max-body-bytes (KVPOOL_MAX_BODY_BYTES)" in line


def test_a_bad_token_is_never_echoed(monkeypatch):
    monkeypatch.setenv("KVPOOL_TOKEN", "")
    with pytest.raises(ValidationError) as exc:
        PoolSettings(token=["s3cret"])
    assert "s3cret" not in describe_error(exc.value)


def test_prefix_hash_is_xxh3_unless_set_and_names_its_choices(monkeypatch):
    assert PoolSettings().prefix_hash == "xxh3"
    monkeypatch.setenv("KVPOOL_PREFIX_HASH", "sha256")
    assert PoolSettings().prefix_hash == "sha256"
    assert parse(["--prefix-hash", "xxh3"]).prefix_hash == "xxh3"
    with pytest.raises(SystemExit):
        parse(["--prefix-hash", "md5"])
    monkeypatch.setenv("KVPOOL_PREFIX_HASH", "md5")
    with pytest.raises(ValidationError) as refused:
        PoolSettings()
    assert "--prefix-hash (KVPOOL_PREFIX_HASH)" in describe_error(refused.value)
