"""Who may own the pool's sockets: checked before a client sends its token, and before the pool binds.

Whoever can put a socket of theirs at the path a client connects to collects that client's token and can hand it a
fake arena descriptor. On a shared node the default path lives in a shared directory (``/tmp``), where another
user may create ``kvpool-<uid>`` first, or plant a symbolic link. So a Unix socket is trusted only when the
socket, its directory, and every directory above it belong to a trusted user (this process's user, root, or the
pool's user named by ``KVPOOL_POOL_UID``) and none of them can be changed by anyone else: no directory on the way
writable by group or others unless sticky, and no symbolic link owned by an untrusted user.
"""

from __future__ import annotations

import os
import stat

from kvpool.errors import UntrustedSocket

POOL_UID_ENV = "KVPOOL_POOL_UID"


def trusted_uids() -> set[int]:
    """This process's user, root, and the pool's user if it runs as another one (``KVPOOL_POOL_UID``)."""
    uids = {os.getuid(), 0}
    named = os.environ.get(POOL_UID_ENV, "").strip()
    if named:
        if not named.isdigit():
            raise UntrustedSocket(f"{POOL_UID_ENV} must be a numeric user id, got {named!r}")
        uids.add(int(named))
    return uids


def _untrusted(what: str, path: str, why: str) -> UntrustedSocket:
    return UntrustedSocket(
        f"refusing the pool's {what} {path}: {why}. Another user could stand in for the pool there and collect "
        f"your token; remove it, or point KVPOOL_URL at a socket in a directory only the pool's user can change "
        f"(if the pool runs as another user who shares the socket through its group, set {POOL_UID_ENV} to its uid)"
    )


def directory_problem(directory: str | os.PathLike[str], uids: set[int]) -> str | None:
    """Why an untrusted user could replace an entry of ``directory`` (or of a directory above it); None if none can."""
    given = os.path.abspath(directory)
    if stat.S_ISLNK(os.lstat(given).st_mode):
        return f"{given} is a symbolic link"
    part = ""
    for name in given.split("/")[1:]:  # a link on the way may be re-pointed by its owner at any time
        part = f"{part}/{name}"
        link = os.lstat(part)
        if stat.S_ISLNK(link.st_mode) and link.st_uid not in uids:
            return f"{part} is a symbolic link of uid {link.st_uid}"
    d, up = os.path.realpath(given), None
    while d != up:  # the directory and each one above it, up to /
        st = os.stat(d)
        if st.st_uid not in uids:
            return f"{d} belongs to uid {st.st_uid}, not to a trusted user (uids {sorted(uids)})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            who = "world-writable" if st.st_mode & stat.S_IWOTH else "group-writable"
            return f"{d} is {who} without the sticky bit: others could replace the socket"
        d, up = os.path.dirname(d), d
    return None


def check_socket(path: str | os.PathLike[str]) -> None:
    """Raise unless ``path`` is a socket of a trusted user in a directory only trusted users can change.

    A path that does not exist passes: connecting to it fails on its own, with no token sent.
    """
    uids = trusted_uids()
    given = os.path.abspath(path)
    try:
        st = os.lstat(given)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise _untrusted("socket", given, "it is a symbolic link")
    if not stat.S_ISSOCK(st.st_mode):
        raise _untrusted("socket", given, "it is not a socket")
    if st.st_uid not in uids:
        raise _untrusted("socket", given, f"it belongs to uid {st.st_uid}, not to a trusted user")
    problem = directory_problem(os.path.dirname(given), uids)
    if problem is not None:
        raise _untrusted("socket", given, problem)
