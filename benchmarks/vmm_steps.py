"""Where a VMM arena's attach time goes: each step of ``PoolClient.arena()`` timed on its own, in fresh processes.

``python -m kvpool.benchmarks.vmm_steps [--sizes 1GiB,64GiB] [--rounds 4] [--device 0]`` starts one pool per size
(``--arena-handle vmm``) and, per round and size, two fresh processes forked from this one (torch imported, CUDA
never touched here, so each child makes its own context as a worker does):

* ``steps`` replays the attach step by step as it was before the fd brought the descriptor (``GET /arena``
  first), and as :func:`kvpool.arena._map_vmm` and :func:`kvpool.vmm.import_map` do it: the modules it imports,
  the CUDA runtime (found both ways) and driver libraries' loading, the fast channel's connection and
  ``arena_fd`` exchange, ``cuMemImportFromShareableHandle``, ``cuMemAddressReserve``, ``cuMemMap``,
  ``cuMemSetAccess``, the tensor wrap, the per-layer views and the first touch. Then it maps the same fd again,
  warm: as is, with the reservation's alignment left to the driver, and aligned to 1 GiB, to tell
  once-per-process costs from per-mapping ones.
* ``arena`` times ``client.arena()`` whole (the ``map`` phase of ``kvpool bench attach``), for the sum to be
  checked against.

Prints the p50 and min of each step in µs. A GPU with VMM and POSIX fd handles is needed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvpool.benchmarks import harness, machine
from kvpool.benchmarks.attach import LAYOUT


def _steps(url: str, index: int) -> dict[str, int]:
    import torch

    out: dict[str, int] = {}
    clock = time.perf_counter_ns

    def step(name: str, fn: Callable[[], Any]) -> Any:
        t0 = clock()
        value = fn()
        out[name] = clock() - t0
        return value

    from kvpool.client import PoolClient

    step("cuda context (apart)", lambda: (torch.cuda.set_device(index), torch.empty(1, device=f"cuda:{index}")))
    client = step("session (apart)", lambda: PoolClient(url, name="steps", heartbeat=False))
    t_map = clock()
    descriptor = step("GET /arena", client.descriptor)
    step("import kvpool.cuda, vmm", lambda: __import__("kvpool.vmm"))
    from kvpool import cuda, vmm
    from kvpool.arena import Arena

    step("cudart found by a /proc/self/maps scan (before)", _cudart_by_maps)
    step("cudart load", cuda.cudart)
    step("cudaSetDevice", lambda: cuda.set_device(index))
    lib = step("libcuda load + cuInit", vmm.driver)
    step("primary context made current by the driver (now)", lambda: vmm.use_device(index))
    access = step("peers", lambda: vmm.peers(index))
    step("fast channel connect + hello", client.transport.connection)
    fd = step("arena_fd exchange (fd received)", lambda: client.mapper.arena_fd(descriptor, None))
    spare = os.dup(fd)
    nbytes = descriptor.nbytes
    ptr = _map(lib, vmm, fd, nbytes, index, access, step, "")
    raw = step("torch.as_tensor wrap", lambda: torch.as_tensor(cuda.DeviceBuffer(ptr, nbytes), device=f"cuda:{index}"))
    step("per-layer views (Arena)", lambda: Arena(descriptor, raw))
    out["sum to here (= map)"] = clock() - t_map
    step("touch (.item())", lambda: int(raw[nbytes - 1].item()))
    for label, align in (("warm, ", None), ("warm align 0, ", 0), ("warm align 1 GiB, ", 1 << 30)):
        again = os.dup(spare)
        p = _map(lib, vmm, again, nbytes, index, access, step, label, align)
        vmm.unmap(p, nbytes)
    os.close(spare)
    client.close()
    return out


def _cudart_by_maps() -> ctypes.CDLL | None:
    """How :func:`kvpool.cuda.cudart` found the runtime before: the path of the libcudart in /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            if "libcudart" in path:
                return ctypes.CDLL(path)
    return None


def _map(lib: Any, vmm: Any, fd: int, nbytes: int, index: int, access: list[int], step: Any, label: str,
         align: int | None = None) -> int:  # fmt: skip
    """:func:`kvpool.vmm.import_map`, one driver call per step."""
    handle, ptr = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    kind = vmm.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    def driver_step(name: str, fn: Callable[[], int]) -> None:
        vmm._check(step(f"{label}{name}", fn), name)

    try:
        driver_step(
            "cuMemImportFromShareableHandle",
            lambda: lib.cuMemImportFromShareableHandle(ctypes.byref(handle), ctypes.c_void_p(fd), kind),
        )
    finally:
        os.close(fd)
    gran = step(f"{label}granularity query", lambda: vmm.granularity(index))
    alignment = gran if align is None else align
    driver_step("cuMemAddressReserve", lambda: lib.cuMemAddressReserve(ctypes.byref(ptr), nbytes, alignment, 0, 0))
    driver_step("cuMemMap", lambda: lib.cuMemMap(ptr.value, nbytes, 0, handle.value, 0))
    where = [vmm.MemLocation(vmm.CU_MEM_LOCATION_TYPE_DEVICE, d) for d in access]
    descs = (vmm.AccessDesc * len(access))(*(vmm.AccessDesc(w, vmm.CU_MEM_ACCESS_FLAGS_PROT_READWRITE) for w in where))
    driver_step("cuMemSetAccess", lambda: lib.cuMemSetAccess(ptr.value, nbytes, descs, len(access)))
    driver_step("cuMemRelease (imported handle)", lambda: lib.cuMemRelease(handle.value))
    return ptr.value


def _whole(url: str, index: int) -> dict[str, int]:
    import torch

    from kvpool.client import PoolClient

    torch.cuda.set_device(index)
    torch.empty(1, device=f"cuda:{index}")
    client = PoolClient(url, name="whole", heartbeat=False)
    t0 = time.perf_counter_ns()
    arena = client.arena()
    t1 = time.perf_counter_ns()
    int(arena.raw[arena.raw.numel() - 1].item())
    t2 = time.perf_counter_ns()
    client.close()
    return {"client.arena() (= map)": t1 - t0, "touch (.item())": t2 - t1}


def _forked(fn: Callable[[str, int], dict[str, int]], url: str, index: int) -> dict[str, int]:
    """``fn`` in a child forked from this process (which never initialised CUDA), its result over a pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read)
            os.write(write, json.dumps(fn(url, index)).encode())
        except BaseException as exc:
            os.write(write, json.dumps({"error": repr(exc)}).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    result = json.loads(data or b'{"error": "the child died without an answer"}')
    if "error" in result:
        raise RuntimeError(f"{fn.__name__} child failed: {result['error']}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=harness.size_list, default=[1 << 30, 64 << 30], help="[1GiB,64GiB]")
    parser.add_argument("--rounds", type=int, default=4, help="measured rounds, after one warm-up [4]")
    parser.add_argument("--device", type=int, default=0, help="CUDA ordinal of the arena [0]")
    args = parser.parse_args()
    import torch  # noqa: F401 - imported once here, before the forks, as a worker has it

    device = machine.Device("cuda", args.device)
    flags = [*harness.layout_flags(LAYOUT), "--arena-handle", "vmm"]
    samples: dict[tuple[int, str], list[dict[str, int]]] = {}
    with harness.servers(*(lambda s=s: harness.start_pool(device, *flags, "--arena-bytes", str(s))
                           for s in args.sizes)) as pools:  # fmt: skip
        for r in range(args.rounds + 1):
            for size, pool in zip(args.sizes, pools, strict=True):
                for fn in (_steps, _whole):
                    result = _forked(fn, pool.url, args.device)
                    if r:
                        samples.setdefault((size, fn.__name__), []).append(result)
    for size in args.sizes:
        print(f"\nVMM arena of {harness.fmt_bytes(size)}: p50 / min of {args.rounds} fresh processes (µs)")
        for mode in ("_steps", "_whole"):
            trials = samples[(size, mode)]
            for name in trials[0]:
                values = [t[name] / 1e3 for t in trials]
                print(f"  {name:44s} {statistics.median(values):10.1f} {min(values):10.1f}")


if __name__ == "__main__":
    main()
