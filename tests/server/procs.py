"""Start ``kvpool serve`` with exactly the flags a test gives (``start_pool`` always passes --socket/--port)."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path

from kvpool.server.launch import child_env, spawn
from tests.conftest import PoolProcess

SMALL_LAYOUT = (
    "--num-blocks", "64", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
    "--block-size", "4", "--dtype", "float32",
)  # fmt: skip


def serve(
    flags: list[str],
    *,
    port: int,
    socket: Path,
    env: dict[str, str] | None = None,
    wait: bool = True,
    timeout_s: float = 60.0,
) -> PoolProcess:
    """Run ``kvpool serve <flags>``; ``port`` and ``socket`` are where the test expects it (not passed for it).

    With ``wait``, return once ``/health`` on the port answers 200; otherwise return at once (for a pool that
    is expected to refuse to start).
    """
    log = Path(tempfile.mkdtemp(prefix="kvp-log-")) / "pool.log"
    args = ["kvpool", "serve", "--backend", "cpu", "--log-level", "warning", *flags]
    inherited = {k: v for k, v in child_env().items() if not k.startswith("KVPOOL_")}
    pool = spawn(args, socket=socket, port=port, log=log, env={**inherited, **(env or {})}, wait=wait,
                 timeout_s=timeout_s, workdir=log.parent)  # fmt: skip
    # a pool expected to refuse is never stopped by its test: its log goes with it all the same
    weakref.finalize(pool, shutil.rmtree, log.parent, True)
    return pool
