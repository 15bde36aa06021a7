"""The requests the client writes by hand on the direct path say what the models would."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.protocol import ClaimRequest, HandoffRequest, claim_json, handoff_json

ids = st.text(min_size=1, max_size=40)
metas = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8), st.none()), max_size=4)


@given(
    session=st.text(max_size=20),
    request=ids,
    tokens=st.integers(0, 1 << 40),
    meta=metas,
    ttl=st.one_of(st.none(), st.floats(0.001, 86400)),
    to=st.one_of(st.none(), ids),
)
def test_a_hand_written_handoff_is_the_model_s_own(session, request, tokens, meta, ttl, to):
    body = handoff_json(session, request, tokens, json.dumps(meta, separators=(",", ":")).encode(), ttl, to)
    fields = {"session_id": session, "request_id": request, "num_tokens": tokens, "meta": meta, "ttl_s": ttl, "to": to}
    assert json.loads(body) == {**fields, "block_ids": [], "keep": False, "sealed": False}
    assert HandoffRequest.model_validate_json(body) == HandoffRequest(block_ids=[], **fields)


@given(session=st.text(max_size=20), request=ids, timeout=st.floats(0, 3600))
def test_a_hand_written_claim_is_the_model_s_own(session, request, timeout):
    body = claim_json(session, request, timeout)
    assert ClaimRequest.model_validate_json(body) == ClaimRequest(
        session_id=session, request_id=request, timeout_s=timeout
    )


def test_the_hand_written_fields_are_every_field_of_the_models():
    """A field added to a model fails here until the hand-written request carries it too."""
    handoff = json.loads(handoff_json("s", "r", 1, b"{}", None, None))
    claim = json.loads(claim_json("s", "r", 1.0))
    assert set(handoff) == set(HandoffRequest.model_fields)
    assert set(claim) == set(ClaimRequest.model_fields)


@pytest.mark.parametrize("ttl", [None, 0.5, 60.0])
def test_ttl_goes_as_json(ttl):
    assert json.loads(handoff_json("s", "r", 0, b"{}", ttl, "x"))["ttl_s"] == ttl


def test_every_model_has_its_validator_built_at_import():
    """A model whose validator is left for its first use pays for the build inside that call (the VMM attach's
    arena_fd answer did, most of a millisecond): every wire model is ready once kvpool.protocol is imported."""
    from pydantic import BaseModel

    from kvpool import protocol
    from kvpool.slab import protocol as slab_protocol

    models = [
        m
        for module in (protocol, slab_protocol)
        for m in vars(module).values()
        if isinstance(m, type) and issubclass(m, BaseModel) and m.__module__ == module.__name__
    ]
    assert protocol.ArenaFdResponse in models
    assert [m.__name__ for m in models if not m.__pydantic_complete__] == []


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300))
def test_packed_tokens_are_the_token_ids_they_pack(token_ids):
    from kvpool.protocol import CommitRequest, LookupItem, LookupRequest
    from kvpool.tokens import pack_tokens

    packed = pack_tokens(token_ids)
    assert packed is not None
    for model, extra in ((LookupRequest, {"session_id": "s"}), (LookupItem, {}),
                         (CommitRequest, {"session_id": "s", "block_ids": []})):  # fmt: skip
        req = model.model_validate_json(json.dumps({"tokens": packed, **extra}))
        assert list(req.token_seq()) == token_ids
        assert list(model(token_ids=token_ids, **extra).token_seq()) == token_ids


def test_a_token_that_is_no_uint32_is_not_packed():
    from kvpool.tokens import pack_tokens

    assert pack_tokens([1, -1]) is None
    assert pack_tokens([2**32]) is None
    assert pack_tokens([]) == ""


@pytest.mark.parametrize(
    ("body", "words"),
    [({}, ["token_ids is missing"]), ({"tokens": "AQAAAA==", "token_ids": [1]}, ["not both"])],
)
def test_a_request_gives_its_tokens_one_way(body, words):
    from pydantic import ValidationError

    from kvpool.protocol import LookupRequest

    with pytest.raises(ValidationError) as err:
        LookupRequest.model_validate_json(json.dumps({"session_id": "s", **body}))
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(("tokens", "words"), [("AQID", ["3 bytes"]), ("@@@@", ["base64"]), ("AQ", ["base64"])])
def test_tokens_that_pack_no_token_ids_are_refused_where_they_are_read(tokens, words):
    """Unpacked where the pool uses them, once (the client that packed them never pays for it)."""
    from kvpool.errors import InvalidRequest
    from kvpool.protocol import LookupRequest

    req = LookupRequest.model_validate_json(json.dumps({"session_id": "s", "tokens": tokens}))
    with pytest.raises(InvalidRequest) as err:
        req.token_seq()
    for word in words:
        assert word in str(err.value)
