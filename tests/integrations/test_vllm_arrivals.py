"""The arrival hook: every new request reaches its engine's connector from the input thread, and intake never
breaks because of it (no vLLM needed: the wrapper is tried on stand-ins of vLLM's engine core)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvpool.integrations.vllm import arrivals


def preprocess(core: Any, request: str) -> tuple[str, int]:
    return f"req:{request}", 0


def core_with(connector: Any) -> SimpleNamespace:
    return SimpleNamespace(scheduler=SimpleNamespace(get_kv_connector=lambda: connector))


def test_each_new_request_reaches_the_engines_connector_and_intake_is_unchanged() -> None:
    seen: list[str] = []
    wrapped = arrivals.wrap(preprocess)
    assert wrapped(core_with(SimpleNamespace(on_arrival=seen.append)), "r1") == ("req:r1", 0)
    assert seen == ["req:r1"]


def test_a_connector_without_the_hook_or_an_engine_without_one_is_left_alone() -> None:
    wrapped = arrivals.wrap(preprocess)
    assert wrapped(core_with(object()), "r2") == ("req:r2", 0)
    assert wrapped(core_with(None), "r3") == ("req:r3", 0)
    assert wrapped(SimpleNamespace(), "r4") == ("req:r4", 0)


def test_a_hook_that_fails_never_fails_the_request(caplog: pytest.LogCaptureFixture) -> None:
    def broken(request: Any) -> None:
        raise RuntimeError("pool session gone")

    assert arrivals.wrap(preprocess)(core_with(SimpleNamespace(on_arrival=broken)), "r5") == ("req:r5", 0)
    assert "starts at scheduling" in caplog.text


def test_the_engine_core_is_wrapped_once_however_many_connectors_start() -> None:
    core = pytest.importorskip("vllm.v1.engine.core", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")
    before = core.EngineCore.preprocess_add_request
    try:
        assert arrivals.install() and arrivals.install()
        once = core.EngineCore.preprocess_add_request
        assert getattr(once, "_kvpool_arrivals", False)
        assert once.__wrapped__ in (before, getattr(before, "__wrapped__", None))
    finally:
        core.EngineCore.preprocess_add_request = before
