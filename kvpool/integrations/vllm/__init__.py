"""kvpool inside vLLM: a KV connector that vLLM loads with ``kv_connector_module_path``.

``--kv-transfer-config '{"kv_connector": "KvpoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm",
"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}'`` (see docs/vllm.md). The connector class needs vLLM
(``pip install -e ".[vllm]"`` from a checkout) and is imported only when asked for, so the pure parts (the step
plans, the K/V views of vLLM's cache, the proxy) import without it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvpoolConnector", "ResidentAsyncScheduler", "ResidentScheduler"]


def __getattr__(name: str) -> Any:
    if name == "KvpoolConnector":
        from kvpool.integrations.vllm.connector import KvpoolConnector

        return KvpoolConnector
    if name in ("ResidentScheduler", "ResidentAsyncScheduler"):  # --scheduler-cls (vLLM 0.29-0.30)
        from kvpool.integrations.vllm import schedulers

        return getattr(schedulers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
