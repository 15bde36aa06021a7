"""Request and response models of the control API, shared by the server and :mod:`kvpool.client`.

Past 400 lines on purpose: every model of the wire in one module, so the client, the HTTP app and the fast channel
read the same ones.

Requests are strict (a string is not a number, unknown fields are refused), so that a client bug shows up as a
422 that names the field rather than as a silently coerced value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from kvpool.errors import InvalidRequest
from kvpool.ids import BLOCK_MASK
from kvpool.layout import KVLayout
from kvpool.tokens import packed_count, packed_length, unpack_tokens

MAX_IDS = 1 << 20
MAX_TOKENS = 1 << 22

Role = Literal["prefill", "decode", "other"]
SessionId = str
RequestId = str


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class SessionCreate(_Request):
    name: str = Field(min_length=1, max_length=128)
    role: Role = "other"
    layout: KVLayout | None = Field(
        None, description="The client's model layout; a mismatch with the arena's is refused (409)."
    )
    inbox: bool = Field(
        False,
        description="ask for an inbox: a Unix datagram socket path where producers deliver handoffs addressed to "
        "this session straight to it (only where the pool serves the fast channel)",
    )
    name_key: str | None = Field(
        None,
        min_length=16,
        max_length=256,
        description="a secret that holds the name: once a session opened the name with a key, only a session that "
        "gives the same key may open it again, also after the first one ended (a restarted worker takes its name "
        "back, nobody else can); a name opened with another key, or none, is 409",
    )


class SessionRef(_Request):
    session_id: SessionId = Field(max_length=64)


class Hello(_Request):
    token: str | None = Field(None, max_length=4096)


class ArenaFdRequest(_Request):
    """Ask the fast channel for a VMM arena's file descriptor (it comes back attached, SCM_RIGHTS)."""

    session_id: SessionId = Field(max_length=64)
    device: int | None = Field(None, description="the arena's device as the pool names it; null: the first")


class ArenaFdResponse(BaseModel):
    epoch: str
    index: int
    nbytes: int
    descriptor: ArenaDescriptor | None = Field(
        None, description="the whole arena descriptor, so that a client mapping by fd needs no GET /arena first"
    )


class SessionInfo(BaseModel):
    session_id: str
    lease_ttl_s: float
    epoch: str
    fast_socket: str | None = Field(None, description="Unix socket of the fast channel, if the pool serves one")
    arena_fd: bool = Field(
        False, description="the first arena is a VMM allocation: fast-channel arena_fd gives its fd and descriptor"
    )
    inbox: str | None = Field(None, description="where this session should bind its inbox, if it asked for one")
    inbox_key: str | None = Field(
        None,
        description="hex key that deliveries to this session's inbox are sealed with; told to this session alone",
    )


class SessionSummary(BaseModel):
    """What other workers may know of a session: never its id, which acts for it."""

    name: str
    role: str
    inbox: str | None
    age_s: float


class SessionList(BaseModel):
    sessions: list[SessionSummary]


class HeldBlocks(BaseModel):
    block_ids: list[int] = Field(
        description="the blocks this session holds refs on, as fenced ids, an id once per ref: what the pool releases "
        "when the session ends (slab blocks included)"
    )


DEVICE_HELP = "the arena's device, as the pool names it (GET /arena `arenas`); default: the pool's first"


class AllocRequest(_Request):
    session_id: SessionId = Field(max_length=64)
    num_blocks: int = Field(ge=1, le=1 << 31)
    device: int | None = Field(None, ge=0, le=1 << 16, description=DEVICE_HELP)


class AllocResponse(BaseModel):
    block_ids: list[int]


class FreeRequest(_Request):
    session_id: SessionId = Field(max_length=64)
    block_ids: list[int] = Field(max_length=MAX_IDS)


class FreeResponse(BaseModel):
    freed: int


SALT_HELP = (
    "mixed into the first block's hash (a tenant, a LoRA adapter): chains of different salts, or none, never share "
    "blocks; a lookup finds what was committed with the same salt"
)
TOKENS_HELP = (
    "the token ids packed instead of token_ids: little-endian uint32, base64 (standard alphabet, padded); what "
    "kvpool.client sends, and cheaper to write and to read than a JSON integer per token"
)


class _WithTokens(_Request):
    """A request about a prompt's tokens, given as ``token_ids`` or packed as ``tokens`` (one of the two). Packed
    tokens are unpacked where they are used (:meth:`token_seq`), once: the client that packs them never pays it."""

    token_ids: list[int] = Field(default_factory=list, max_length=MAX_TOKENS)
    tokens: str | None = Field(None, max_length=packed_length(MAX_TOKENS), description=TOKENS_HELP)
    _unpacked: Sequence[int] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _one_form(self) -> _WithTokens:
        if self.tokens is None:
            if "token_ids" not in self.model_fields_set:
                raise ValueError("token_ids is missing: give token_ids, or tokens (packed)")
        elif self.token_ids:
            raise ValueError("give token_ids or tokens, not both")
        return self

    def token_seq(self) -> Sequence[int]:
        """The prompt's token ids, whichever way they came; InvalidRequest if ``tokens`` packs none."""
        if self.tokens is None:
            return self.token_ids
        if self._unpacked is None:
            try:
                self._unpacked = unpack_tokens(self.tokens)  # at most MAX_TOKENS: the string's length bounds them
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
        return self._unpacked

    def token_count(self) -> int:
        """How many token ids the request names, without unpacking them."""
        return len(self.token_ids) if self.tokens is None else packed_count(self.tokens)


class CommitRequest(_WithTokens):
    session_id: SessionId = Field(max_length=64)
    block_ids: list[int] = Field(max_length=MAX_IDS)
    salt: str | None = Field(None, min_length=1, max_length=256, description=SALT_HELP)
    start: int = Field(
        0, ge=0, le=MAX_TOKENS,
        description="full blocks of token_ids that the pool's index already holds (a prefix you looked up): "
        "block_ids then hold block start onwards; if the pool no longer holds that prefix, nothing is committed",
    )  # fmt: skip
    release: bool = Field(False, description="then drop your refs on block_ids, as free would (commit and let go)")


class CommitResponse(BaseModel):
    committed: int = Field(description="blocks newly indexed")
    duplicates: int = Field(description="full blocks whose content was already indexed")
    num_blocks: int = Field(description="full blocks in token_ids")
    missing: int = Field(0, description="blocks of the first start that the pool no longer held (then none committed)")


class LookupRequest(_WithTokens):
    session_id: SessionId = Field(max_length=64)
    device: int | None = Field(None, ge=0, le=1 << 16, description=DEVICE_HELP)
    salt: str | None = Field(None, min_length=1, max_length=256, description=SALT_HELP)


class LookupResponse(BaseModel):
    block_ids: list[int]
    num_tokens: int


MAX_LOOKUPS = 1024


class LookupItem(_WithTokens):
    salt: str | None = Field(None, min_length=1, max_length=256, description=SALT_HELP)


class LookupManyRequest(_Request):
    """Several lookups in one call: a scheduler asks for a whole step's arrivals with one round trip."""

    session_id: SessionId = Field(max_length=64)
    lookups: list[LookupItem] = Field(min_length=1, max_length=MAX_LOOKUPS)
    device: int | None = Field(None, ge=0, le=1 << 16, description=DEVICE_HELP)

    @model_validator(mode="after")
    def _bounded(self) -> LookupManyRequest:
        total = sum(x.token_count() for x in self.lookups)
        if total > MAX_TOKENS:
            raise ValueError(f"the lookups hold {total} tokens in all; at most {MAX_TOKENS} go in one call")
        return self


class LookupManyResponse(BaseModel):
    hits: list[LookupResponse]


class HandoffRequest(_Request):
    session_id: SessionId = Field(max_length=64)
    request_id: RequestId = Field(min_length=1, max_length=256)
    block_ids: list[int] = Field(max_length=MAX_IDS)
    num_tokens: int = Field(ge=0, le=1 << 40)
    meta: dict[str, Any] = Field(default_factory=dict)
    ttl_s: float | None = Field(None, gt=0, le=86400, description="unclaimed after this long, the blocks are released")
    to: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="the name of the one live session that may claim it (default: any session)",
    )
    keep: bool = Field(
        False,
        description="the handoff takes refs of its own on the blocks and the session keeps its refs (default: the "
        "session's refs move to the handoff)",
    )
    sealed: bool = Field(
        False,
        description="only a claim that names request_id takes it: a claim with no request_id never does (park under "
        "an unguessable request_id, and pass it to the consumer alone)",
    )


class HandoffResponse(BaseModel):
    request_id: str
    num_blocks: int
    inbox: str | None = Field(None, description="the addressee's inbox, if it has one (see `to`)")
    slab: bool = Field(
        False,
        description="sent from the producer's slab to the addressee's slab box, no pool on "
        "the way (the pool moves the refs afterwards)",
    )


class ClaimRequest(_Request):
    session_id: SessionId = Field(max_length=64)
    request_id: RequestId | None = Field(
        None, max_length=256, description="the request to claim; null takes the oldest parked handoff"
    )
    timeout_s: float = Field(0.0, ge=0, le=3600)


class ClaimResponse(BaseModel):
    request_id: str
    block_ids: list[int]
    num_tokens: int
    meta: dict[str, Any]
    parked_by: str | None = Field(
        None, description="the name of the session that parked it, as the pool knows it (null from an older pool)"
    )


class AcceptResponse(BaseModel):
    """The fast channel's answer to ``accept``: a claim of a handoff whose ids the claimer already has."""

    request_id: str
    num_blocks: int
    num_tokens: int


class Health(BaseModel):
    status: Literal["ok", "starting"]
    epoch: str


class DeviceInfo(BaseModel):
    index: int
    uuid: str
    name: str = ""


HandleKind = Literal["cuda_ipc", "vmm", "shm"]
HANDLE_DOC = (
    "base64 CUDA IPC handle (cuda_ipc), the shared-memory file's path (shm), or, for vmm, a name only: the "
    "allocation is a file descriptor handed over the fast channel's Unix socket (op arena_fd) to a live session"
)
KIND_DOC = "how the arena is shared: cuda_ipc (legacy 64-byte handle), vmm (POSIX fd), shm (/dev/shm file)"


class ArenaPart(BaseModel):
    """One device's arena: its blocks are the global ids ``first_block .. first_block + num_blocks - 1``."""

    index: int = Field(description="the device as the pool names it (its --devices entry)")
    device: DeviceInfo | None
    handle: str = Field(description=HANDLE_DOC)
    nbytes: int
    num_blocks: int
    first_block: int = 0
    handle_kind: HandleKind | None = Field(None, description=KIND_DOC)


class HostTierPart(BaseModel):
    """The pool's host tier: a shared-memory file of ``num_blocks`` blocks, each one contiguous run of bytes
    (``[2 * num_layers, block_size * num_kv_heads * head_dim]``, K then V per layer), whatever the arena's order."""

    handle: str = Field(description="the host tier file's path (map it shared; page-lock it to copy on CUDA)")
    nbytes: int
    num_blocks: int


class ArenaDescriptor(BaseModel):
    """The arena a client maps. The top-level fields describe one arena (the first, or the one asked for);
    ``arenas`` lists every device's when the pool serves several."""

    epoch: str
    backend: Literal["cuda", "cpu"]
    device: DeviceInfo | None
    handle: str = Field(description=HANDLE_DOC)
    handle_kind: HandleKind = Field(description=KIND_DOC)
    nbytes: int
    num_blocks: int
    block_nbytes: int
    layout: KVLayout
    owner_pid: int
    model: str = ""
    fast_socket: str | None = Field(None, description="Unix socket of the binary fast channel, if served")
    prefix_hash: Literal["xxh3", "sha256"] = Field("xxh3", description="the hash of prefix chains (--prefix-hash)")
    first_block: int = 0
    arenas: list[ArenaPart] = Field(default_factory=list)
    host_tier: HostTierPart | None = Field(None, description="where evicted prefix blocks go, if the pool has one")
    slab_slots: int = Field(
        0, description="blocks one session's reservation slab can hold (--slab-max-blocks); 0: the pool serves no slabs"
    )

    def part(self, device: int | None) -> ArenaDescriptor:
        """The descriptor of one device's arena (``device`` as the pool names it; None: the first)."""
        if device is None or not self.arenas:
            return self
        for part in self.arenas:
            if part.index == device:
                fields = {k: getattr(part, k) for k in ("device", "handle", "nbytes", "num_blocks", "first_block")}
                return self.model_copy(update={**fields, "handle_kind": part.handle_kind or self.handle_kind})
        raise ValueError(f"the pool has no arena on device {device}; it has {[p.index for p in self.arenas]}")

    def device_of(self, block_id: int) -> int | None:
        """The device whose arena holds ``block_id`` (None on a pool that lists no arenas)."""
        block_id &= BLOCK_MASK  # a fenced id's block
        for part in self.arenas:
            if part.first_block <= block_id < part.first_block + part.num_blocks:
                return part.index
        return None


# ArenaFdResponse names ArenaDescriptor, defined after it: pydantic leaves such a model's validator to be built at
# its first use, which was a VMM worker's first arena_fd answer (most of a millisecond of the attach).
ArenaFdResponse.model_rebuild()


class ErrorBody(BaseModel):
    detail: Any
    error: str


# The direct path's critical path writes these two requests by hand: building and dumping the pydantic model
# costs more than the rest of the path. tests/test_protocol.py keeps them equal to the models' own JSON; the pool
# validates them as it validates any request.
_HANDOFF_JSON = (
    b'{"session_id":%s,"request_id":%s,"block_ids":[],"num_tokens":%d,"meta":%s,"ttl_s":%s,"to":%s,"keep":false,'
    b'"sealed":false}'
)
_CLAIM_JSON = b'{"session_id":%s,"request_id":%s,"timeout_s":%r}'


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def handoff_json(
    session_id: str, request_id: str, num_tokens: int, meta: bytes, ttl_s: float | None, to: str | None
) -> bytes:
    """A :class:`HandoffRequest` whose ids go attached; ``meta`` is already JSON (it also goes to the inbox)."""
    ttl = b"null" if ttl_s is None else b"%r" % float(ttl_s)
    return _HANDOFF_JSON % (_json(session_id), _json(request_id), num_tokens, meta, ttl, _json(to))


def claim_json(session_id: str, request_id: str, timeout_s: float) -> bytes:
    """A :class:`ClaimRequest` of one request (also the body of an ``accept``)."""
    return _CLAIM_JSON % (_json(session_id), _json(request_id), float(timeout_s))
