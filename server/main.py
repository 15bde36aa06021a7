"""``kvpool serve``: bind the sockets, start the control plane, run until a signal."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from pathlib import Path

import uvicorn

from kvpool.config import PoolSettings
from server.app import create_app
from server.fastpath import FastChannel
from server.plane import ControlPlane

log = logging.getLogger("kvpool")


def bind_tcp(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.set_inheritable(True)
    return sock


def bind_unix(path: Path, mode: int) -> socket.socket:
    """Bind a Unix socket, replacing a stale file but never a live pool's socket."""
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
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
    sock.bind(str(path))
    os.chmod(path, mode)
    return sock


def serve(settings: PoolSettings) -> None:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plane = ControlPlane(settings)
    app = create_app(plane)
    sockets = []
    if settings.port:
        sockets.append(bind_tcp(settings.host, settings.port))
    if settings.socket is not None:
        sockets.append(bind_unix(settings.socket, settings.socket_mode))
    if settings.fast_socket is not None:
        fast = FastChannel(plane, settings.fast_socket, settings.socket_mode, settings.max_body_bytes)
        app.state.on_start.append(fast.start)
        app.state.on_stop.append(fast.stop)
    config = uvicorn.Config(app, log_level=settings.log_level, access_log=False, timeout_keep_alive=30, lifespan="on")
    server = uvicorn.Server(config)
    app.state.on_fatal = lambda: setattr(server, "should_exit", True)
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
    try:
        server.run(sockets=sockets)
    finally:
        plane.close()
        if settings.socket is not None:
            with contextlib.suppress(FileNotFoundError):
                settings.socket.unlink()
    if plane.startup_error:
        raise SystemExit(f"kvpool: could not start: {plane.startup_error}")
