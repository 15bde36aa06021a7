"""Lookups that start when a request reaches the engine process, not when it reaches the scheduler.

vLLM's engine core decodes arriving requests on its input thread while its busy loop runs a step, and the
scheduler takes them in only between steps (``on_new_request``). In a burst, all but the first few requests wait in
that queue for the whole first step (20-37 ms on an H100), and a lookup started only when the scheduler takes them
in then keeps the GPU idle while it runs (7-10 ms for 30 prompts). Started on the input thread, the lookups run
beside that first step instead.

vLLM 0.26 gives a connector no hook on that thread, so :func:`install` wraps ``EngineCore.preprocess_add_request``,
the one function that both the input thread and the in-process client call on every new request, and hands the
request to its engine's connector if that connector has ``on_arrival``. The wrapper never raises on the connector's
behalf: an arrival it cannot tell about is looked up when the scheduler takes it in, as without it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("vllm.kvpool")

_WRAPPED = "_kvpool_arrivals"


def install() -> bool:
    """Wrap ``EngineCore.preprocess_add_request`` once per process; False where this vLLM has no such method."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return False
    original = getattr(EngineCore, "preprocess_add_request", None)
    if original is None:
        log.info("kvpool: this vLLM has no EngineCore.preprocess_add_request; lookups start at scheduling")
        return False
    if getattr(original, _WRAPPED, False):
        return True
    EngineCore.preprocess_add_request = wrap(original)  # type: ignore[method-assign]
    return True


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def preprocess_add_request(core: Any, request: Any) -> Any:
        out = original(core, request)
        tell(core, out[0])
        return out

    setattr(preprocess_add_request, _WRAPPED, True)
    return preprocess_add_request


def tell(core: Any, request: Any) -> None:
    """Hand a new request to the engine's connector's ``on_arrival``, if it has one."""
    try:
        get = getattr(getattr(core, "scheduler", None), "get_kv_connector", None)
        on_arrival = getattr(get() if get is not None else None, "on_arrival", None)
        if on_arrival is not None:
            on_arrival(request)
    except Exception:
        log.warning("kvpool: starting a lookup on arrival failed; it starts at scheduling", exc_info=True)
