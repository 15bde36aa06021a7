"""vLLM scheduler classes for resident mode, named with ``--scheduler-cls`` where the connector alone cannot make
vLLM's block pool resident (vLLM 0.29 and 0.30, whose connector never sees the ``KVCacheManager``).

After vLLM's own ``__init__`` (which builds the connector, then the ``KVCacheManager``), the scheduler hands the
manager to its connector's resident side, which swaps the class of the manager and of its one ``BlockPool``
(:func:`.blockpool.adopt`). No vLLM attribute is replaced. With a connector that is not resident, or none, the
scheduler is vLLM's own.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler


class ResidentScheduler(Scheduler):
    """vLLM's ``Scheduler`` over a resident block pool."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        side = getattr(self.connector, "_resident_sched", None)
        if side is not None:
            side.adopt(self.kv_cache_manager)


class ResidentAsyncScheduler(ResidentScheduler, AsyncScheduler):
    """vLLM's ``AsyncScheduler`` (the default with async scheduling) over a resident block pool."""
