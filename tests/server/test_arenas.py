"""--arena-handle: its setting, how auto chooses, and the descriptor naming the kind of handle (no GPU needed)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvpool import vmm
from kvpool.arena import open_arena
from kvpool.errors import InvalidRequest
from kvpool.layout import KVLayout
from kvpool.protocol import ArenaDescriptor, DeviceInfo
from kvpool.server.arenas import OwnedArena, describe, resolve_handle
from kvpool.server.config import PoolSettings, add_settings_arguments, settings_from_args


def parse(argv: list[str]) -> PoolSettings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser, PoolSettings)
    return settings_from_args(parser.parse_args(argv))


def test_the_setting_defaults_to_auto_and_reads_flag_and_variable(monkeypatch, tmp_path):
    assert PoolSettings().arena_handle == "auto"
    monkeypatch.setenv("KVPOOL_ARENA_HANDLE", "legacy")
    assert PoolSettings().arena_handle == "legacy"
    assert parse(["--arena-handle", "vmm", "--socket", str(tmp_path / "p.sock")]).arena_handle == "vmm"


def test_unknown_kinds_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse(["--arena-handle", "ipc"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--socket", "none"], ["--no-fast-channel"]], ids=["no-socket", "no-fast"])
def test_vmm_without_a_unix_fast_channel_is_refused_with_the_way_out(argv):
    with pytest.raises(ValidationError, match="--arena-handle legacy"):
        parse(["--arena-handle", "vmm", *argv])


def test_auto_and_legacy_start_without_a_fast_channel():
    assert parse(["--arena-handle", "auto", "--no-fast-channel"]).fast_socket is None
    assert parse(["--arena-handle", "legacy", "--socket", "none"]).arena_handle == "legacy"


@pytest.mark.parametrize(
    ("setting", "fd_passing", "why", "kind"),
    [
        ("auto", True, None, "vmm"),
        ("vmm", True, None, "vmm"),
        ("legacy", True, None, "legacy"),
        ("auto", False, None, "legacy"),
        ("auto", True, "device 0 does not support virtual memory management", "legacy"),
    ],
)
def test_how_the_handle_kind_is_chosen(monkeypatch, setting, fd_passing, why, kind):
    monkeypatch.setattr(vmm, "supported", lambda device: why)
    assert resolve_handle(setting, 0, fd_passing) == kind


def test_vmm_asked_for_where_it_cannot_be_is_an_error_not_a_fallback(monkeypatch):
    with pytest.raises(InvalidRequest, match="serves none"):
        resolve_handle("vmm", 0, fd_passing=False)
    monkeypatch.setattr(vmm, "supported", lambda device: "device 0 does not support POSIX file descriptor handles")
    with pytest.raises(InvalidRequest, match="POSIX file descriptor handles; use --arena-handle legacy"):
        resolve_handle("vmm", 0, fd_passing=True)


class FakeArena(OwnedArena):
    backend = "cuda"

    def __init__(self, kind: str, device: int) -> None:
        self.handle_kind = kind  # type: ignore[assignment]
        self.handle = f"vmm:{device}" if kind == "vmm" else "AAAA"
        self.nbytes = 2 << 20
        self.device = DeviceInfo(index=device, uuid=f"GPU-{device}")

    def close(self) -> None:
        pass


def test_the_descriptor_names_the_kind_of_every_arena():
    layout = KVLayout()
    arenas = [FakeArena("vmm", 0), FakeArena("cuda_ipc", 1)]
    desc = describe("e1", [0, 1], arenas, [8, 8], layout, "", "/run/kvpool/kvpool.sock.fast")  # type: ignore[arg-type]
    assert desc.handle_kind == "vmm" and desc.handle == "vmm:0"
    assert [p.handle_kind for p in desc.arenas] == ["vmm", "cuda_ipc"]
    assert desc.part(1).handle_kind == "cuda_ipc" and desc.part(0).handle_kind == "vmm"
    again = ArenaDescriptor.model_validate_json(desc.model_dump_json())
    assert again.handle_kind == "vmm" and again.part(1).handle_kind == "cuda_ipc"


def test_a_vmm_arena_is_not_mapped_without_the_pool_handing_its_fd():
    desc = describe("e2", [0], [FakeArena("vmm", 0)], [8], KVLayout(), "", None)  # type: ignore[list-item]
    with pytest.raises(InvalidRequest, match=r"PoolClient\.arena"):
        open_arena(desc)


def test_the_cpu_pool_says_its_arena_is_shared_as_a_file(pool_server):
    with pool_server.http() as http:
        desc = http.get("/arena").json()
    assert desc["handle_kind"] == "shm" and Path(desc["handle"]).exists()
    assert {p["handle_kind"] for p in desc["arenas"]} == {"shm"}
