"""A process of the VMM tests: writes the arena's first and last blocks, reads them in another, or tries to map
the arena without being handed its fd.

``python -m tests.gpu.vmm_worker write|read URL REQUEST_ID`` and ``stranger URL DESCRIPTOR_JSON TOKEN``. Each prints
one JSON line: its PID (1 when it runs in a PID namespace of its own), the pool's PID as the descriptor has it, and
how long mapping took.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import torch

from kvpool import vmm
from kvpool.arena import open_arena
from kvpool.channel import FastConnection
from kvpool.client import PoolClient
from kvpool.errors import InvalidRequest, Unauthorized
from kvpool.protocol import ArenaDescriptor, ArenaFdRequest

FIRST, LAST = 1.5, -2.25


def mapped(pool: PoolClient) -> tuple[object, float]:
    t0 = time.perf_counter()
    arena = pool.arena()
    arena.raw[arena.raw.numel() - 1].item()
    return arena, (time.perf_counter() - t0) * 1e3


def write(url: str, request_id: str) -> dict:
    with PoolClient(url, name="vmm-writer", role="prefill") as pool:
        arena, ms = mapped(pool)
        ids = pool.alloc(arena.num_blocks)  # every block: the arena's first and last are among them
        first, last = min(ids), max(ids)
        for block, value in ((first, FIRST), (last, LAST)):
            for view in arena.block(block):
                view.fill_(value)
        torch.cuda.synchronize()
        pool.handoff(request_id, [first, last], 2 * arena.layout.block_size, {})
        pool.free([i for i in ids if i not in (first, last)])
        return {
            "pid": os.getpid(),
            "pool_pid": arena.descriptor.owner_pid,
            "map_ms": ms,
            "kind": arena.descriptor.handle_kind,
            "nbytes": arena.descriptor.nbytes,
            "blocks": [first, last],
        }


def read(url: str, request_id: str) -> dict:
    with PoolClient(url, name="vmm-reader", role="decode") as pool:
        arena, ms = mapped(pool)
        got = pool.claim(request_id, timeout_s=60)
        ok = all(
            bool((view == value).all())
            for block, value in zip(got.block_ids, (FIRST, LAST), strict=True)
            for view in arena.block(block)
        )
        pool.free(got.block_ids)
        return {
            "pid": os.getpid(),
            "pool_pid": arena.descriptor.owner_pid,
            "map_ms": ms,
            "read_ok": ok,
            "blocks": got.block_ids,
        }


def stranger(url: str, descriptor: str, token: str) -> dict:
    """Everything but the fd: the descriptor, the GPU, the pool's socket; then, as a control, the token."""
    desc = ArenaDescriptor.model_validate_json(descriptor)
    out: dict = {"pid": os.getpid(), "pool_pid": desc.owner_pid}
    try:
        open_arena(desc)
        out["descriptor_alone"] = "MAPPED"
    except InvalidRequest as exc:
        out["descriptor_alone"] = f"refused: {exc}"[:80]
    assert desc.fast_socket is not None
    conn = FastConnection(desc.fast_socket, timeout_s=10)
    hello, _ = conn.call(b"hello", json.dumps({"token": "not-" + token}).encode())
    body = ArenaFdRequest(session_id=f"{desc.epoch[:8]}-0000000000000000").model_dump_json().encode()
    status, _, fd = conn.call_fd(b"arena_fd", body)
    conn.close()
    out["wrong_token"] = {"hello": hello, "arena_fd": status, "fd": fd}
    try:
        PoolClient(url, name="stranger", token="not-" + token)
        out["session_without_token"] = "OPENED"
    except Unauthorized:
        out["session_without_token"] = "refused"
    # fd numbers mean nothing in another process: import every number this process has not opened itself
    imported = []
    for number in range(3, 256):
        try:
            os.fstat(number)
            continue
        except OSError:
            pass
        handle = ctypes.c_ulonglong()
        code = vmm.driver().cuMemImportFromShareableHandle(
            ctypes.byref(handle), ctypes.c_void_p(number), vmm.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        )
        if code == 0:
            imported.append(number)
            vmm.release(handle.value)
    out["imported_by_number"] = imported
    with PoolClient(url, name="stranger-with-token", token=token) as pool:  # the control: same process, handed it
        arena, out["map_ms_with_token"] = mapped(pool)
        out["with_token"] = arena.descriptor.handle_kind
    return out


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "write":
        out = write(argv[1], argv[2])
    elif mode == "read":
        out = read(argv[1], argv[2])
    else:
        out = stranger(argv[1], argv[2], argv[3])
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
