"""The JSON-lines requests a prefill worker reads, and the metadata a handoff carries to the decode side.

A request is ``{"request_id": str, "prompt": [int], "max_new_tokens": int, "salt": str}``; the prompt is token ids
(the workers have no tokenizer: tokenizing is the serving front end's job). The optional ``salt`` (a tenant, a LoRA
adapter) goes with the request's prefix lookups and commits: only requests with the same salt share cached blocks.
A handoff's ``meta`` is the small JSON the pool parks beside the block ids, everything the decode worker needs to
go on without asking the prefill.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int = 16
    salt: str | None = None

    @classmethod
    def from_json(cls, line: str) -> GenerationRequest:
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError("a request is a JSON object")
        req = cls(
            request_id=str(data["request_id"]),
            prompt=[int(t) for t in data["prompt"]],
            max_new_tokens=int(data.get("max_new_tokens", 16)),
            salt=data.get("salt"),
        )
        if req.salt is not None and not (isinstance(req.salt, str) and 1 <= len(req.salt) <= 256):
            raise ValueError(f"request {req.request_id!r}: salt must be a string of 1 to 256 characters")
        if not req.prompt:
            raise ValueError(f"request {req.request_id!r}: the prompt is empty")
        check_tokens(req.request_id, req.prompt)
        if req.max_new_tokens < 1:
            raise ValueError(f"request {req.request_id!r}: max_new_tokens must be at least 1")
        return req

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def check_tokens(request_id: str, tokens: list[int], vocab_size: int | None = None) -> None:
    """Refuse a token id the model cannot embed, so that one bad request is refused and the worker serves on."""
    for t in tokens:
        if t < 0:
            raise ValueError(f"request {request_id!r}: token id {t} is negative")
        if vocab_size is not None and t >= vocab_size:
            raise ValueError(
                f"request {request_id!r}: token id {t} is not in the model's vocabulary (0 to {vocab_size - 1})"
            )


def read_requests(stream: IO[str]) -> Iterator[GenerationRequest]:
    """Requests from a JSON-lines stream; blank lines are skipped."""
    for line in stream:
        if line.strip():
            yield GenerationRequest.from_json(line)


@dataclass(frozen=True)
class HandoffMeta:
    """What the prefill tells the decode side besides the block ids.

    ``first_token`` was sampled from the prompt's last logits; ``arrived_at``/``handed_off_at`` are wall-clock
    seconds (``time.time()``: both workers run on one node, so their clocks agree) for end-to-end timings.
    ``prompt``, when the prefill sends it, lets a decode worker that must preempt the request free its blocks
    and recompute them later; without it a preempted request keeps its blocks while it waits. ``salt`` is the
    request's, so that such a recompute finds only the blocks its own salt committed.
    """

    prompt_len: int
    first_token: int
    max_new_tokens: int
    arrived_at: float
    handed_off_at: float
    computed_tokens: int
    hit_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)
    prompt: list[int] | None = None
    salt: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HandoffMeta:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    @classmethod
    def checked(cls, request_id: str, data: dict[str, Any], vocab_size: int) -> HandoffMeta:
        """The meta of a handoff, or a ValueError saying why a decode worker cannot decode it."""
        try:
            meta = cls.from_dict(data)
        except TypeError as exc:
            raise ValueError(f"request {request_id!r}: its handoff's meta is not a prefill's: {exc}") from None
        if type(meta.first_token) is not int or type(meta.max_new_tokens) is not int or meta.max_new_tokens < 1:
            raise ValueError(f"request {request_id!r}: first_token and max_new_tokens (at least 1) must be integers")
        check_tokens(request_id, [meta.first_token, *(meta.prompt or [])], vocab_size)
        return meta
