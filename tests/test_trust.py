"""Who may own the pool's socket, checked before a client sends its token: the socket, its directory and every one
above it must be a trusted user's, and nobody else may change them."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool import trust
from kvpool.errors import UntrustedSocket


@pytest.fixture
def private(tmp_path: Path) -> Path:
    """A directory only this user can change (pytest's own are; /tmp above them is sticky)."""
    d = tmp_path / "kvpool"
    d.mkdir(mode=0o750)
    return d


@pytest.fixture
def sock(private: Path) -> Iterator[Path]:
    path = private / "kvpool.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    yield path
    s.close()


def test_this_user_s_socket_in_a_private_directory_is_trusted(sock: Path) -> None:
    trust.check_socket(sock)
    assert trust.directory_problem(sock.parent, trust.trusted_uids()) is None


def test_a_socket_that_is_not_there_passes_the_connect_fails_on_its_own(private: Path) -> None:
    trust.check_socket(private / "nothing.sock")


def test_a_link_or_a_file_where_the_socket_should_be_is_refused(sock: Path, private: Path) -> None:
    link = private / "link.sock"
    link.symlink_to(sock)
    with pytest.raises(UntrustedSocket, match="it is a symbolic link") as refused:
        trust.check_socket(link)
    assert "KVPOOL_URL" in str(refused.value)  # says what to do
    plain = private / "plain.sock"
    plain.write_text("")
    with pytest.raises(UntrustedSocket, match="it is not a socket"):
        trust.check_socket(plain)


@pytest.mark.parametrize(("mode", "why"), [(0o770, "group-writable"), (0o777, "world-writable")])
def test_a_directory_others_may_write_is_refused_unless_sticky(sock: Path, mode: int, why: str) -> None:
    os.chmod(sock.parent, mode)
    with pytest.raises(UntrustedSocket, match=f"is {why} without the sticky bit"):
        trust.check_socket(sock)
    os.chmod(sock.parent, mode | 0o1000)  # sticky, as /tmp is: others may add, never replace what is ours
    trust.check_socket(sock)


def test_the_socket_s_directory_may_not_be_a_link_one_above_it_only_a_trusted_user_s(
    sock: Path, tmp_path: Path
) -> None:
    linked = tmp_path / "linked"
    linked.symlink_to(sock.parent, target_is_directory=True)
    with pytest.raises(UntrustedSocket, match=f"{linked} is a symbolic link"):
        trust.check_socket(linked / sock.name)
    above = tmp_path / "above"
    above.symlink_to(tmp_path, target_is_directory=True)
    trust.check_socket(above / sock.parent.name / sock.name)  # a trusted user's link on the way lets nobody else in
    assert "is a symbolic link of uid" in (trust.directory_problem(above / sock.parent.name, {4242}) or "")


def test_a_socket_or_a_directory_of_a_user_not_trusted_is_refused(sock: Path, monkeypatch) -> None:
    stranger = {os.getuid() + 4242}  # whom the pool's files do not belong to
    assert "not to a trusted user" in (trust.directory_problem(sock.parent, stranger) or "")
    monkeypatch.setattr(trust, "trusted_uids", lambda: stranger)
    with pytest.raises(UntrustedSocket, match=f"belongs to uid {os.getuid()}, not to a trusted user"):
        trust.check_socket(sock)


def test_the_pool_s_own_user_is_trusted_when_named(monkeypatch) -> None:
    monkeypatch.delenv(trust.POOL_UID_ENV, raising=False)
    assert trust.trusted_uids() == {os.getuid(), 0}
    monkeypatch.setenv(trust.POOL_UID_ENV, "4242")
    assert trust.trusted_uids() == {os.getuid(), 0, 4242}
    monkeypatch.setenv(trust.POOL_UID_ENV, "pool")
    with pytest.raises(UntrustedSocket, match="must be a numeric user id"):
        trust.trusted_uids()
