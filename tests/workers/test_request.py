"""The JSON-lines requests the workers read: what is accepted, and what is refused with a message."""

from __future__ import annotations

import io
import json

import pytest

from kvpool.workers.request import GenerationRequest, read_requests


def test_a_request_round_trips_with_its_salt() -> None:
    req = GenerationRequest("r1", [1, 2, 3], 4, salt="tenant-a")
    assert GenerationRequest.from_json(req.to_json()) == req
    plain = GenerationRequest.from_json('{"request_id": "r2", "prompt": [5]}')
    assert (plain.max_new_tokens, plain.salt) == (16, None)


def test_blank_lines_are_skipped() -> None:
    lines = '{"request_id": "a", "prompt": [1]}\n\n  \n{"request_id": "b", "prompt": [2], "salt": "x"}\n'
    assert [(r.request_id, r.salt) for r in read_requests(io.StringIO(lines))] == [("a", None), ("b", "x")]


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"prompt": []}, "the prompt is empty"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
        ({"salt": 7}, "salt must be a string"),
        ({"salt": ""}, "salt must be a string"),
        ({"salt": "s" * 257}, "salt must be a string"),
    ],
)
def test_bad_requests_are_refused_with_the_reason(fields: dict[str, object], why: str) -> None:
    line = json.dumps({"request_id": "bad", "prompt": [1, 2], **fields})
    with pytest.raises(ValueError, match=why):
        GenerationRequest.from_json(line)


def test_a_request_is_an_object() -> None:
    with pytest.raises(ValueError, match="a request is a JSON object"):
        GenerationRequest.from_json("[1, 2]")
