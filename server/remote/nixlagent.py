"""The pool's NIXL agent: its arena registered once, reads from peers' arenas posted and polled.

NIXL (the transfer engine vLLM, Dynamo and llm-d use across nodes) is an optional extra, ``kvpool[nixl]``, imported
only when a pool is given ``--peers``. Memory is registered once at start, never per transfer: registration pins
pages and, over RDMA, makes keys, which costs far more than a read. Over UCX with TCP (two pools on one machine,
CI) a read needs the peer's process to answer; over RDMA the peer's NIC does, its process need not run.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
from collections.abc import Sequence
from typing import Any, Literal

from kvpool.errors import InvalidRequest
from kvpool.runs import Span

State = Literal["PROC", "DONE", "ERR"]

INSTALL = "pip install -e '.[nixl]' from a kvpool checkout (the nixl-cu13 wheel)"


def load_nixl() -> Any:
    """NIXL's Python API under whichever name this install gives it; InvalidRequest saying what to install."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise InvalidRequest(f"--peers needs NIXL, which is not installed: {INSTALL}")


class NixlAgent:
    def __init__(self, name: str, base: int, nbytes: int, memory: Literal["DRAM", "VRAM"], device: int) -> None:
        api = load_nixl()
        self.name, self.memory, self.device = name, memory, device
        self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
        self._registered = self._agent.register_memory(self._agent.get_reg_descs([(base, nbytes, device, "")], memory))
        self._peers: dict[bytes, str] = {}
        self.keep: object = None  # what keeps the registered memory mapped, if the agent's owner maps it for it

    def metadata(self) -> str:
        return base64.b64encode(self._agent.get_agent_metadata()).decode()

    def connect(self, metadata: str) -> str:
        """The peer's name in this agent, its metadata loaded once."""
        raw = base64.b64decode(metadata)
        name = self._peers.get(raw)
        if name is None:
            name = self._agent.add_remote_agent(raw)
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[raw] = name
        return name

    def forget(self, peer: str) -> None:
        """Drop a peer that failed: its next use loads its metadata again (it may have restarted)."""
        for raw, name in list(self._peers.items()):
            if name == peer:
                del self._peers[raw]
                with contextlib.suppress(Exception):  # a peer already gone is what we are forgetting
                    self._agent.remove_remote_agent(name)

    def post_read(self, peer: str, local: Sequence[Span], remote: Sequence[Span], peer_memory: str) -> Any:
        """Start reading ``remote`` spans of ``peer`` into ``local`` spans: one NIXL descriptor per pair."""
        mine = self._agent.get_xfer_descs([(a, n, self.device) for a, n in local], self.memory)
        theirs = self._agent.get_xfer_descs([(a, n, 0) for a, n in remote], peer_memory)
        handle = self._agent.initialize_xfer("READ", mine, theirs, peer)
        if self._agent.transfer(handle) == "ERR":
            self._agent.release_xfer_handle(handle)
            raise ConnectionError(f"NIXL refused to post a read from {peer}")
        return handle

    def state(self, handle: Any) -> tuple[State, str]:
        """Where a read stands, and NIXL's reason when it failed (a peer gone is an error NIXL raises)."""
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:  # NIXL raises its own error types for a peer gone
            return "ERR", f"{type(exc).__name__}: {exc}"
        if state in ("PROC", "DONE"):
            return state, ""
        return "ERR", f"NIXL says {state}"

    def release(self, handle: Any) -> None:
        with contextlib.suppress(Exception):  # a handle of a failed read may be gone with its peer
            self._agent.release_xfer_handle(handle)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # the process is going away
            self._agent.deregister_memory(self._registered)
