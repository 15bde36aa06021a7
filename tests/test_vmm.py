"""How a worker maps a VMM arena's fd, checked against a stand-in for the driver (the GPU tests map real ones):
one mapping, one access grant over all of it, the device's primary context made current through the driver, and
a refused grant undoing the mapping."""

from __future__ import annotations

import os
import threading
import warnings

import pytest

from kvpool import vmm
from kvpool.arena import Beside
from kvpool.cuda import CudaError

PTR = 0x7F00_0000_0000
NBYTES = 8 << 20


class FakeDriver:
    """The driver calls of a mapping, recorded in order."""

    def __init__(self, access_code: int = 0) -> None:
        self.calls: list[str] = []
        self.contexts: dict[int, int] = {}
        self.access_code = access_code
        self.access: dict[str, object] = {}

    def _log(self, name: str) -> int:
        self.calls.append(name)
        return 0

    def cuMemImportFromShareableHandle(self, handle, fd, kind) -> int:
        handle._obj.value = 7
        return self._log("import")

    def cuMemGetAllocationGranularity(self, size, prop, flag) -> int:
        size._obj.value = 2 << 20
        return 0

    def cuMemAddressReserve(self, ptr, nbytes, align, addr, flags) -> int:
        ptr._obj.value = PTR
        return self._log("reserve")

    def cuMemMap(self, ptr, nbytes, offset, handle, flags) -> int:
        return self._log("map")

    def cuMemSetAccess(self, ptr, nbytes, descs, count) -> int:
        self.access = {"devices": [descs[i].location.id for i in range(count)], "range": (ptr, nbytes)}
        self._log("set access")
        return self.access_code

    def cuMemUnmap(self, ptr, nbytes) -> int:
        return self._log("unmap")

    def cuMemAddressFree(self, ptr, nbytes) -> int:
        return self._log("free address")

    def cuMemRelease(self, handle) -> int:
        return self._log("release handle")

    def cuDeviceGet(self, dev, ordinal) -> int:
        dev._obj.value = ordinal
        return self._log(f"device {ordinal}")

    def cuDevicePrimaryCtxRetain(self, ctx, dev) -> int:
        ctx._obj.value = 0xC0 + dev.value
        return self._log(f"retain primary of {dev.value}")

    def cuCtxSetCurrent(self, ctx) -> int:
        self.contexts[threading.get_ident()] = ctx.value
        return self._log(f"current {ctx.value:#x}")

    def cuDeviceGetCount(self, count) -> int:
        count._obj.value = 3
        return 0

    def cuDeviceCanAccessPeer(self, ok, other, device) -> int:
        ok._obj.value = int((other, device) == (0, 1))
        return 0

    def cuGetErrorString(self, code, text) -> int:
        text._obj.value = b"not permitted"
        return 0


def closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


@pytest.fixture
def fd():
    read, write = os.pipe()
    yield read
    os.close(write)


def test_the_whole_range_is_mapped_once_and_made_accessible_to_every_device_given(monkeypatch, fd):
    fake = FakeDriver()
    monkeypatch.setattr(vmm, "driver", lambda: fake)
    assert vmm.import_map(fd, NBYTES, 0, [0, 1]) == PTR
    assert fake.calls == ["import", "reserve", "map", "set access", "release handle"]
    assert fake.access == {"devices": [0, 1], "range": (PTR, NBYTES)}
    assert closed(fd)


def test_a_refused_access_undoes_the_mapping_and_says_which_call(monkeypatch, fd):
    fake = FakeDriver(access_code=800)
    monkeypatch.setattr(vmm, "driver", lambda: fake)
    with pytest.raises(CudaError, match=r"cuMemSetAccess failed: not permitted \(CUresult 800\)"):
        vmm.import_map(fd, NBYTES, 3)
    assert fake.access["devices"] == [3]
    assert fake.calls[-3:] == ["unmap", "free address", "release handle"]
    assert closed(fd)


def test_work_given_the_pointer_starts_right_before_the_grant(monkeypatch, fd):
    """What runs beside the grant (the arena's views) gets the address once it is mapped, and only then."""
    fake = FakeDriver()
    monkeypatch.setattr(vmm, "driver", lambda: fake)
    vmm.import_map(fd, NBYTES, 0, granting=lambda ptr: fake.calls.append(f"granting {ptr:#x}"))
    assert fake.calls == ["import", "reserve", "map", f"granting {PTR:#x}", "set access", "release handle"]


def test_work_beside_runs_on_its_own_thread_while_the_caller_waits_and_hands_back_its_result_or_error():
    """The caller gives the work and then blocks (in the driver's grant, here on an event the work sets): the work
    must run during that wait, not after it."""
    done = threading.Event()
    ran: dict[str, int] = {}

    def work(ptr: int) -> str:
        ran["thread"], ran["ptr"] = threading.get_ident(), ptr
        done.set()
        return "arena"

    beside = Beside()
    beside.start(work, PTR)  # type: ignore[arg-type]
    assert done.wait(5)
    assert beside.result() == "arena"
    assert ran == {"thread": ran["thread"], "ptr": PTR} and ran["thread"] != threading.get_ident()

    def failing(ptr: int) -> str:
        raise CudaError("no views")

    beside = Beside()
    beside.start(failing, PTR)  # type: ignore[arg-type]
    with pytest.raises(CudaError, match="no views"):
        beside.result()


def test_work_beside_a_mapping_that_failed_first_never_runs():
    beside = Beside()
    beside.cancel()
    assert beside._done.is_set() and beside._out is None


def test_the_mapping_is_granted_to_its_device_and_to_every_device_the_driver_says_can_reach_it(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(vmm, "driver", lambda: fake)
    assert vmm.peers(1) == [1, 0]
    assert vmm.peers(2) == [2]


def test_the_device_s_primary_context_is_made_current_through_the_driver(monkeypatch):
    """What cudaSetDevice did before the mapping, without looking up libcudart for it."""
    fake = FakeDriver()
    monkeypatch.setattr(vmm, "driver", lambda: fake)
    vmm.use_device(2)
    assert fake.calls == ["device 2", "retain primary of 2", "current 0xc2"]
    assert fake.contexts[threading.get_ident()] == 0xC2


def test_getting_ready_for_a_vmm_arena_keeps_one_spare_thread_and_no_driver_is_no_error(monkeypatch):
    """What runs while the pool answers for the fd: here without a GPU, where the mapping itself says why not."""
    from kvpool import arena

    monkeypatch.setattr(arena, "_spare", None)
    monkeypatch.setattr(vmm, "driver", lambda: (_ for _ in ()).throw(CudaError("no libcuda")))
    arena.prepare_vmm()
    spare = arena._spare
    arena.prepare_vmm()
    assert isinstance(spare, Beside) and arena._spare is spare
    spare.cancel()


def test_a_forked_child_does_not_inherit_the_spare_thread(monkeypatch):
    """The thread stays in the parent; a child that took the spare would wait on it forever when it maps."""
    from kvpool import arena

    spare = Beside()
    monkeypatch.setattr(arena, "_spare", spare)
    read, write = os.pipe()
    with warnings.catch_warnings():  # 3.12 warns of forking a process with threads: this test's point
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's clean-up
        os.write(write, b"none" if arena._spare is None else b"kept")
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 8) == b"none" and arena._spare is spare
    os.close(read)
    spare.cancel()


@pytest.mark.parametrize("supported", [1, 0])
def test_the_arena_is_allocated_rdma_capable_where_the_device_allows_it(monkeypatch, supported):
    """Without the flag a NIC cannot read VMM memory directly and UCX falls back (NIXL issue 1754: 0.3 GB/s)."""
    fake, flags = FakeDriver(), []

    def attribute(value, attr, device) -> int:
        value._obj.value = supported if attr == vmm.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED else 1
        return 0

    def create(handle, nbytes, prop, options) -> int:
        flags.append(prop._obj.allocFlags.gpuDirectRDMACapable)
        handle._obj.value = 5
        return 0

    fake.cuDeviceGetAttribute, fake.cuMemCreate = attribute, create
    monkeypatch.setattr(vmm, "driver", lambda: fake)
    assert vmm.create(NBYTES, 0) == 5
    assert flags == [supported] and vmm.rdma_capable(0) is bool(supported)
