"""How a worker maps a VMM arena's fd, checked against a stand-in for the driver (the GPU tests map real ones):
the pointer is wrapped before any access, the access is granted by a second thread, in the caller's context, while
the caller builds on the wrapper, and a failure on either side undoes the mapping."""

from __future__ import annotations

import os
import threading

import pytest

from kvpool import vmm
from kvpool.cuda import CudaError

PTR = 0x7F00_0000_0000
NBYTES = 8 << 20


class FakeDriver:
    """The driver calls of a mapping, recorded with the thread that made them."""

    def __init__(self, access_code: int = 0, wait_for: threading.Event | None = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.contexts = {threading.get_ident(): 0xC0}
        self.access_code = access_code
        self.wait_for = wait_for
        self.access: dict[str, object] = {}

    def _log(self, name: str) -> int:
        self.calls.append((name, threading.get_ident()))
        return 0

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

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

    def cuCtxGetCurrent(self, ctx) -> int:
        ctx._obj.value = self.contexts.get(threading.get_ident())
        return 0

    def cuCtxSetCurrent(self, ctx) -> int:
        self.contexts[threading.get_ident()] = ctx.value
        return self._log(f"current {ctx.value:#x}")

    def cuMemSetAccess(self, ptr, nbytes, descs, count) -> int:
        overlapped = self.wait_for.wait(10) if self.wait_for is not None else None
        self.access = {
            "thread": threading.get_ident(),
            "context": self.contexts.get(threading.get_ident()),
            "devices": [descs[i].location.id for i in range(count)],
            "range": (ptr, nbytes),
            "overlapped": overlapped,
        }
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


def test_the_access_is_granted_by_another_thread_in_the_callers_context_while_the_caller_builds(monkeypatch, fd):
    building = threading.Event()
    fake = FakeDriver(wait_for=building)
    monkeypatch.setattr(vmm, "driver", lambda: fake)
    seen = []

    def wrap(ptr: int) -> str:
        seen.append(("wrap", ptr, threading.get_ident(), fake.names()[-1]))
        return "tensor"

    def build(wrapped: str) -> str:
        seen.append(("build", wrapped, threading.get_ident()))
        building.set()
        return "views"

    assert vmm.import_map_while(fd, NBYTES, 0, [0, 1], wrap, build) == "views"
    me = threading.get_ident()
    assert seen == [("wrap", PTR, me, "map"), ("build", "tensor", me)]  # wrapped once mapped, before any access
    assert fake.access["thread"] != me and fake.access["context"] == 0xC0
    assert fake.access["overlapped"] is True  # the grant was waiting on the build, so the two ran at once
    assert fake.access["devices"] == [0, 1] and fake.access["range"] == (PTR, NBYTES)
    assert [n for n in fake.names() if not n.startswith("current")] == [
        "import", "reserve", "map", "set access", "release handle"
    ]  # fmt: skip
    assert closed(fd)


def test_without_a_build_the_access_is_granted_on_the_calling_thread(monkeypatch, fd):
    fake = FakeDriver()
    monkeypatch.setattr(vmm, "driver", lambda: fake)
    assert vmm.import_map(fd, NBYTES, 3) == PTR
    assert fake.access["thread"] == threading.get_ident() and fake.access["devices"] == [3]
    assert closed(fd)


def test_a_refused_access_undoes_the_mapping_and_says_which_call(monkeypatch, fd):
    fake = FakeDriver(access_code=800)
    monkeypatch.setattr(vmm, "driver", lambda: fake)
    with pytest.raises(CudaError, match=r"cuMemSetAccess failed: not permitted \(CUresult 800\)"):
        vmm.import_map_while(fd, NBYTES, 0, None, lambda ptr: ptr, lambda wrapped: "views")
    assert fake.names()[-3:] == ["unmap", "free address", "release handle"]
    assert closed(fd)


@pytest.mark.parametrize("failing", ["wrap", "build"])
def test_a_failed_wrap_or_build_undoes_the_mapping_after_any_grant(monkeypatch, fd, failing):
    fake = FakeDriver()
    monkeypatch.setattr(vmm, "driver", lambda: fake)

    def fail(_: object) -> None:
        raise ValueError("no tensor")

    wrap, build = (fail, lambda w: w) if failing == "wrap" else (lambda p: p, fail)
    with pytest.raises(ValueError, match="no tensor"):
        vmm.import_map_while(fd, NBYTES, 0, None, wrap, build)
    granted = ["set access"] if failing == "build" else []
    assert [n for n in fake.names() if not n.startswith("current")] == [
        "import", "reserve", "map", *granted, "unmap", "free address", "release handle"
    ]  # fmt: skip
    assert not [t for t in threading.enumerate() if t.name == "kvpool-vmm-access"] and closed(fd)


def test_the_device_s_primary_context_is_made_current_through_the_driver(monkeypatch):
    fake = FakeDriver()
    monkeypatch.setattr(vmm, "driver", lambda: fake)
    vmm.use_device(2)
    assert fake.names() == ["device 2", "retain primary of 2", "current 0xc2"]
    assert fake.contexts[threading.get_ident()] == 0xC2
