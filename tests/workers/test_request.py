"""The JSON-lines requests the workers read: what is accepted, and what is refused with a message."""

from __future__ import annotations

import io
import json

import pytest

from kvpool.workers.request import GenerationRequest, HandoffMeta, check_tokens, read_requests

META = {"prompt_len": 3, "first_token": 5, "max_new_tokens": 4, "arrived_at": 0.0, "handed_off_at": 0.0,
        "computed_tokens": 3, "hit_tokens": 0}  # fmt: skip


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


def test_a_negative_token_id_is_refused_as_the_request_is_read() -> None:
    with pytest.raises(ValueError, match="request 'bad': token id -1 is negative"):
        GenerationRequest.from_json('{"request_id": "bad", "prompt": [3, -1]}')


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    check_tokens("ok", [0, 511], 512)
    with pytest.raises(ValueError, match=r"token id 512 is not in the model's vocabulary \(0 to 511\)"):
        check_tokens("big", [1, 512], 512)


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        ({"first_token": 9}, "its handoff's meta is not a prefill's"),
        ({**META, "first_token": 600}, "token id 600 is not in the model's vocabulary"),
        ({**META, "prompt": [1, -2]}, "token id -2 is negative"),
        ({**META, "first_token": "7"}, "must be integers"),
        ({**META, "max_new_tokens": 0}, "must be integers"),
    ],
)
def test_a_handoff_meta_the_decode_cannot_use_is_refused(meta: dict[str, object], why: str) -> None:
    assert HandoffMeta.checked("r", META, 512).first_token == 5
    with pytest.raises(ValueError, match=why):
        HandoffMeta.checked("r", meta, 512)
