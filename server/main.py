"""``kvpool serve``: bind the sockets, start the control plane, run until a signal."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import uvicorn

from kvpool.commands import Parser
from kvpool.server.arenas import cuda_available
from kvpool.server.config import (
    GROUPS,
    PoolSettings,
    add_settings_arguments,
    backend_problem,
    describe_error,
    settings_from_args,
)
from kvpool.server.plane import ControlPlane
from kvpool.server.shm import shm_problem
from kvpool.server.transports.app import create_app
from kvpool.server.transports.connections import HTTPGuard, RefusalLog, open_files_limit, size_caps
from kvpool.server.transports.fastpath import FastChannel
from kvpool.trust import directory_problem

log = logging.getLogger("kvpool")

SHUTDOWN_GRACE_S = 2.0


def bind_tcp(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(
                f"kvpool serve: {host}:{port} is in use (another pool?): stop it, pick another --port, or --port 0 "
                "to serve the Unix socket only"
            ) from None
        raise SystemExit(f"kvpool serve: cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


class Stopped(Exception):
    """A SIGINT or SIGTERM asked the pool to stop: uvicorn re-raises it once its graceful shutdown is done."""


def _stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signal.Signals(signum).name)


def check_socket_dir(directory: Path) -> None:
    """Refuse a socket directory where another user could swap the pool's socket for their own.

    Whoever can rename files in the directory (or in one above it, or re-point a link on the way) can put a
    socket of theirs at the pool's path, and clients would send it their token and trust the arena it describes:
    a squatter who created the default ``/tmp`` path first, or anyone where a directory is writable by others.
    """
    problem = directory_problem(directory, {os.getuid(), 0})
    if problem is not None:
        raise SystemExit(
            f"kvpool: refusing the socket directory {directory}: {problem}. Use a directory that only the pool's "
            "user can change (share it with clients through its group, read-only), or pick another --socket"
        )


def bind_unix(path: Path, mode: int) -> socket.socket:
    """Bind a Unix socket, replacing a stale file but never a live pool's socket."""
    try:
        path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as exc:
        raise SystemExit(
            f"kvpool serve: --socket {path}: cannot create its directory {path.parent} ({exc.strerror}): pick a "
            "--socket in a directory you can create"
        ) from None
    check_socket_dir(path.parent)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()
        else:
            raise SystemExit(f"another pool is listening on {path}: stop it or pick another --socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise SystemExit(f"kvpool serve: cannot listen on --socket {path}: {exc.strerror or exc}") from None
    os.chmod(path, mode)
    return sock


class PoolServer(uvicorn.Server):
    """uvicorn's server, answering waiting claims (503) as soon as a shutdown starts.

    uvicorn waits for in-flight requests before it runs the app's shutdown, and a claim can wait an hour: the
    claims must be released first, or a SIGTERM would either hang or cut them off without an answer.
    """

    def __init__(self, config: uvicorn.Config, plane: ControlPlane) -> None:
        super().__init__(config)
        self.plane = plane

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.plane.stop_waiting()
        await super().shutdown(sockets=sockets)


def fast_channel(plane: ControlPlane, max_connections: int, refusals: RefusalLog | None = None) -> FastChannel:
    """The fast channel at the settings' ``fast_socket``, bounded as they say."""
    settings = plane.settings
    assert settings.fast_socket is not None
    return FastChannel(
        plane,
        settings.fast_socket,
        settings.socket_mode,
        settings.max_body_bytes,
        max_connections=max_connections,
        hello_timeout_s=settings.hello_timeout_s,
        read_timeout_s=settings.read_timeout_s,
        max_buffered=settings.max_fast_buffer_bytes,
        refusals=refusals,
    )


def serve(settings: PoolSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plane = ControlPlane(settings)
    app = create_app(plane)
    sockets = []
    if settings.port:
        sockets.append(bind_tcp(settings.host, settings.port))
    if settings.socket is not None:
        sockets.append(bind_unix(settings.socket, settings.socket_mode))
    # Every listener has a cap of its own, all of them under the fd limit: a local user who holds the TCP port's
    # connections can then neither keep the Unix sockets' clients out nor leave the pool unable to open a file.
    wanted = {"tcp": settings.max_http_connections} if settings.port else {}
    if settings.socket is not None:
        wanted["unix"] = settings.max_http_connections
    if settings.fast_socket is not None:
        wanted["fast"] = settings.max_fast_connections
    caps = size_caps(wanted, open_files_limit())
    refusals = RefusalLog(plane.count_exceeded)
    if settings.fast_socket is not None:
        fast = fast_channel(plane, caps["fast"], refusals)
        app.state.on_start.append(fast.start)
        app.state.on_stop.append(fast.stop)
    guard = HTTPGuard(
        {k: v for k, v in caps.items() if k != "fast"},
        settings.read_timeout_s,
        refusals,
        settings.max_requests_per_peer,
        settings.token.get_secret_value().encode() if settings.token else None,
    )
    # A /claim may wait up to an hour for its handoff; without a bound on the graceful shutdown, one waiting claim
    # would keep a stopping pool (SIGTERM) alive that long. Every other call finishes in microseconds.
    config = uvicorn.Config(
        app,
        http=guard.protocol(),
        ws="none",  # the pool serves no WebSocket; an upgraded connection would leave its listener's count
        log_level=settings.log_level,
        access_log=False,
        timeout_keep_alive=30,
        lifespan="on",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = PoolServer(config, plane)
    app.state.on_fatal = lambda: setattr(server, "should_exit", True)
    if settings.port and settings.token is None:
        log.warning(
            "TCP port %d takes requests from every local user (socket permissions cannot guard it), and /arena "
            "hands out the arena's handle: set --token, or --port 0 to serve the Unix socket only",
            settings.port,
        )
    log.info(
        "kvpool %s listening on %s",
        plane.epoch,
        ", ".join(
            filter(
                None,
                [
                    f"http://{settings.host}:{settings.port}" if settings.port else "",
                    f"unix://{settings.socket}" if settings.socket else "",
                ],
            )
        ),
    )
    # uvicorn handles the signals during its run and re-raises them after its shutdown, into these handlers: a
    # requested stop ends in the cleanup below and exit status 0, not in a traceback or death by the signal.
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=sockets)
    except Stopped as stop:
        log.info("stopped by %s", stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        plane.close()
        if settings.socket is not None:
            with contextlib.suppress(FileNotFoundError):
                settings.socket.unlink()
    if plane.startup_error:
        raise SystemExit(f"kvpool: could not start: {plane.startup_error}")


def serve_parser() -> Parser:
    """``kvpool serve``'s flags: every setting of :class:`PoolSettings`."""
    parser = Parser(
        prog="kvpool serve",
        usage="kvpool serve [options]",
        description="Run the pool manager until SIGINT or SIGTERM. Every flag is also a KVPOOL_* variable; "
        "flags win over variables. Each flag's help ends with [its default; its variable].",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=36),
    )
    add_settings_arguments(parser, PoolSettings, GROUPS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from pydantic import ValidationError

    args = serve_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"kvpool serve: invalid settings: {describe_error(exc)}", file=sys.stderr)
        return 2
    problem = backend_problem(settings, cuda_available) or shm_problem(settings)
    if problem is not None:
        print(f"kvpool serve: {problem}", file=sys.stderr)
        return 2
    serve(settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
