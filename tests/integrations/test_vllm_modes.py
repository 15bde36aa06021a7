"""The connector's modes as objects (kvpool/integrations/vllm/modes.py): each mode has one object per role with the
whole interface of its role, and the connector picks them at start-up. Needs vLLM; no GPU."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (pip install -e '.[vllm]' from a checkout)")

from kvpool.integrations.vllm import modes
from kvpool.integrations.vllm.connector import KvpoolConnector
from tests.conftest import PoolProcess
from tests.integrations.test_vllm_scheduler import Engine, config, pool, tiny_llama  # noqa: F401


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def interface(protocol: type) -> dict[str, list[str]]:
    return {
        name: list(inspect.signature(fn).parameters)
        for name, fn in vars(protocol).items()
        if callable(fn) and not name.startswith("_")
    }


@pytest.mark.parametrize(
    ("protocol", "cls"),
    [
        (modes.SchedulerMode, modes.CopySchedulerMode),
        (modes.SchedulerMode, modes.ResidentSchedulerMode),
        (modes.WorkerMode, modes.CopyWorkerMode),
        (modes.WorkerMode, modes.ResidentWorkerMode),
    ],
)
def test_each_mode_has_its_role_s_whole_interface(protocol: type, cls: type) -> None:
    want = interface(protocol)
    assert want, "the interface names its methods"
    got = {name: list(inspect.signature(getattr(cls, name)).parameters) for name in want if hasattr(cls, name)}
    assert got == want


def test_the_connector_picks_one_mode_object_per_role(model_dir: Path, pool: PoolProcess) -> None:  # noqa: F811
    e = Engine(config(model_dir, pool.url))
    try:
        sched = e.sched.connector
        assert isinstance(sched, KvpoolConnector) and sched.worker_mode is None
        assert isinstance(sched.scheduler_mode, modes.CopySchedulerMode) and sched._sched is sched.scheduler_mode.side
        assert isinstance(e.worker.worker_mode, modes.CopyWorkerMode) and e.worker.scheduler_mode is None
        assert e.worker._worker is e.worker.worker_mode.side and e.worker._resident_worker is None
    finally:
        e.close()
