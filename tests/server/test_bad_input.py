"""Bad input, over real HTTP to a real pool and over the fast channel: a 4xx that says what was wrong, and the
books exactly as they were.

The state every case runs against: session A holds blocks 0-3 (0 and 1 committed as a prefix of 8 tokens),
session B holds blocks 4-5, a handoff "parked" holds block 6 (taken from B). Each case sends one bad request
and then checks the status, that the JSON body's ``detail`` names the problem, and that free / in use / cached,
the prefix index, the sessions and the handoffs did not move.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvpool.channel import FastConnection
from kvpool.client import PoolClient
from kvpool.errors import (
    HandoffExists,
    HandoffNotFound,
    InvalidRequest,
    NotOwner,
    PayloadTooLarge,
    PoolExhausted,
    StaleBlock,
    UnknownSession,
)
from tests.conftest import SMALL_POOL, LocalPool, local_pool
from tests.server.balance import books

NUM_BLOCKS = 64
BLOCK_SIZE = 4
PREFIX = list(range(100, 108))  # two full blocks of 4 tokens


@dataclass
class World:
    pool: LocalPool
    a: PoolClient
    b: PoolClient
    http: httpx.Client

    @property
    def sa(self) -> str:
        return self.a.session_id

    @property
    def sb(self) -> str:
        return self.b.session_id

    def books(self) -> dict[str, int]:
        return books(self.http.get("/stats").json())


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    pool = local_pool(*SMALL_POOL)
    a = PoolClient(pool.url, name="a")
    b = PoolClient(pool.url, name="b")
    http = pool.http()
    try:
        assert a.alloc(4) == [0, 1, 2, 3]
        assert a.commit([0, 1], PREFIX).committed == 2
        assert b.alloc(3) == [4, 5, 6]
        b.handoff("parked", [6], num_tokens=4)
        world = World(pool, a, b, http)
        assert world.books() == {
            "num_blocks": 64, "free": 57, "in_use": 7, "cached": 0, "quarantined": 0, "indexed": 2, "sessions": 2,
            "handoffs": 1,
        }  # fmt: skip
        yield world
    finally:
        a.close()
        b.close()
        http.close()
        pool.stop()


def _detail_text(body: Any) -> str:
    detail = body["detail"]
    return detail if isinstance(detail, str) else json.dumps(detail)


# (id, method, path, json body or raw bytes, expected status, words the detail must contain)
# "{A}" / "{B}" in a body or path stand for session A's and B's ids.
HTTP_CASES: list[tuple[str, str, str, Any, int, list[str]]] = [
    # ids out of range
    ("free-id-past-end", "POST", "/free", {"session_id": "{A}", "block_ids": [64]}, 400, ["out of range", "64"]),
    ("free-id-negative", "POST", "/free", {"session_id": "{A}", "block_ids": [-1]}, 400, ["out of range", "-1"]),
    ("free-id-huge", "POST", "/free", {"session_id": "{A}", "block_ids": [2**63]}, 400, ["out of range"]),
    # an id of A's block 2, with a generation it never had
    ("free-id-stale", "POST", "/free", {"session_id": "{A}", "block_ids": [2**62 | 2]}, 409, ["stale", str(2**62 | 2)]),
    ("commit-id-past-end", "POST", "/commit",
     {"session_id": "{A}", "block_ids": [0, 99], "token_ids": PREFIX}, 400, ["out of range", "99"]),
    ("handoff-id-past-end", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "r-range", "block_ids": [1000], "num_tokens": 1}, 400, ["out of range"]),
    # a block of another session
    ("free-other-sessions-block", "POST", "/free", {"session_id": "{A}", "block_ids": [4]}, 409,
     ["holds no reference", "4"]),
    ("free-parked-block", "POST", "/free", {"session_id": "{B}", "block_ids": [6]}, 409, ["holds no reference"]),
    ("commit-other-sessions-block", "POST", "/commit",
     {"session_id": "{B}", "block_ids": [2], "token_ids": [1, 2, 3, 4]}, 409, ["holds no reference", "2"]),
    ("handoff-other-sessions-block", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "r-steal", "block_ids": [5], "num_tokens": 1}, 409,
     ["holds no reference"]),
    ("free-never-allocated", "POST", "/free", {"session_id": "{A}", "block_ids": [40]}, 409, ["holds no reference"]),
    # one ref freed twice in one call (the "double free" across calls is its own test below)
    ("free-same-block-twice", "POST", "/free", {"session_id": "{A}", "block_ids": [2, 2]}, 409,
     ["listed more times"]),
    # counts: zero, negative, past the schema, past the pool
    ("alloc-zero", "POST", "/alloc", {"session_id": "{A}", "num_blocks": 0}, 422, ["num_blocks", "greater"]),
    ("alloc-negative", "POST", "/alloc", {"session_id": "{A}", "num_blocks": -3}, 422, ["num_blocks"]),
    ("alloc-past-schema", "POST", "/alloc", {"session_id": "{A}", "num_blocks": 2**40}, 422, ["num_blocks", "less"]),
    ("alloc-bignum", "POST", "/alloc", {"session_id": "{A}", "num_blocks": 10**30}, 422, ["num_blocks"]),
    ("alloc-more-than-pool", "POST", "/alloc", {"session_id": "{A}", "num_blocks": 65}, 507,
     ["asked for 65 blocks", "in use"]),
    ("handoff-negative-tokens", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "r-neg", "block_ids": [2], "num_tokens": -1}, 422, ["num_tokens"]),
    ("handoff-tokens-overflow-blocks", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "r-big", "block_ids": [2], "num_tokens": 5}, 400, ["does not fit"]),
    ("handoff-zero-ttl", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "r-ttl", "block_ids": [2], "num_tokens": 1, "ttl_s": 0}, 422, ["ttl_s"]),
    ("claim-negative-timeout", "POST", "/claim", {"session_id": "{A}", "timeout_s": -1}, 422, ["timeout_s"]),
    ("commit-token-negative", "POST", "/commit",
     {"session_id": "{A}", "block_ids": [2], "token_ids": [1, 2, 3, -4]}, 400, ["token ids", "2**32"]),
    ("lookup-token-too-big", "POST", "/lookup", {"session_id": "{A}", "token_ids": [2**32, 1, 2, 3]}, 400,
     ["token ids"]),
    ("commit-fewer-ids-than-blocks", "POST", "/commit",
     {"session_id": "{A}", "block_ids": [2], "token_ids": list(range(8))}, 400, ["2 blocks", "1 block ids"]),
    ("commit-block-listed-twice", "POST", "/commit",
     {"session_id": "{A}", "block_ids": [2, 2], "token_ids": list(range(8))}, 400, ["twice"]),
    ("commit-cached-block-other-tokens", "POST", "/commit",
     {"session_id": "{A}", "block_ids": [0], "token_ids": [9, 9, 9, 9]}, 400, ["already holds cached KV"]),
    ("alloc-unknown-device", "POST", "/alloc", {"session_id": "{A}", "num_blocks": 1, "device": 7}, 400,
     ["no arena on device 7"]),
    ("lookup-unknown-device", "POST", "/lookup", {"session_id": "{A}", "token_ids": PREFIX, "device": 3}, 400,
     ["no arena on device 3"]),
    ("lookups-none", "POST", "/lookups", {"session_id": "{A}", "lookups": []}, 422, ["lookups", "at least 1"]),
    ("lookups-too-many", "POST", "/lookups", {"session_id": "{A}", "lookups": [{"token_ids": [1]}] * 1025}, 422,
     ["lookups", "at most 1024"]),
    # the first lookup would hit and take refs: the second's bad token refuses the whole call first
    ("lookups-token-too-big-in-second", "POST", "/lookups",
     {"session_id": "{A}", "lookups": [{"token_ids": PREFIX}, {"token_ids": [2**32, 1, 2, 3]}]}, 400, ["token ids"]),
    ("lookups-unknown-device", "POST", "/lookups", {"session_id": "{A}", "lookups": [{"token_ids": PREFIX}],
     "device": 3}, 400, ["no arena on device 3"]),
    ("lookups-unknown-field-in-one", "POST", "/lookups",
     {"session_id": "{A}", "lookups": [{"token_ids": PREFIX, "limit": 1}]}, 422, ["limit", "extra"]),
    ("lookups-unknown-session", "POST", "/lookups", {"session_id": "nope", "lookups": [{"token_ids": PREFIX}]}, 404,
     ["unknown session"]),
    ("lookup-empty-salt", "POST", "/lookup", {"session_id": "{A}", "token_ids": PREFIX, "salt": ""}, 422, ["salt"]),
    ("commit-salt-too-long", "POST", "/commit",
     {"session_id": "{A}", "block_ids": [2], "token_ids": PREFIX, "salt": "x" * 257}, 422, ["salt"]),
    ("lookup-salt-not-a-string", "POST", "/lookup", {"session_id": "{A}", "token_ids": PREFIX, "salt": 7}, 422,
     ["salt"]),
    ("alloc-negative-device", "POST", "/alloc", {"session_id": "{A}", "num_blocks": 1, "device": -1}, 422,
     ["device"]),
    # tokens packed (little-endian uint32, base64) instead of token_ids
    ("lookup-tokens-not-base64", "POST", "/lookup", {"session_id": "{A}", "tokens": "not base64!"}, 400,
     ["tokens", "base64"]),
    ("lookup-tokens-ragged", "POST", "/lookup", {"session_id": "{A}", "tokens": "AQID"}, 400,
     ["3 bytes", "4-byte"]),
    ("commit-tokens-and-token-ids", "POST", "/commit",
     {"session_id": "{A}", "block_ids": [2], "token_ids": PREFIX, "tokens": "AQAAAA=="}, 422, ["not both"]),
    ("commit-tokens-not-a-string", "POST", "/commit", {"session_id": "{A}", "block_ids": [2], "tokens": [1]}, 422,
     ["tokens"]),
    # the first lookup would hit and take refs: the second's bad tokens refuse the whole call first
    ("lookups-tokens-bad-in-second", "POST", "/lookups",
     {"session_id": "{A}", "lookups": [{"token_ids": PREFIX}, {"tokens": "AQ"}]}, 400, ["base64"]),
    # malformed JSON and bodies that are not JSON at all
    ("json-truncated", "POST", "/alloc", b'{"session_id": "x", "num_blocks": ', 422, ["json_invalid"]),
    ("json-empty-body", "POST", "/alloc", b"", 422, ["body"]),
    ("json-garbage", "POST", "/free", b"not json", 422, ["json_invalid"]),
    ("json-trailing-comma", "POST", "/lookup", b'{"session_id": "x", "token_ids": [1,],}', 422, ["json_invalid"]),
    ("json-bad-utf8", "POST", "/alloc", b'{"session_id": "\xff\xfe", "num_blocks": 1}', 400, ["UnicodeDecodeError"]),
    ("json-too-deep", "POST", "/handoff", b'{"meta": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, ["Recursion"]),
    ("json-array-body", "POST", "/alloc", [1, 2], 422, ["dictionary"]),
    ("json-lone-surrogate", "POST", "/sessions", b'{"name": "\\ud800"}', 422, ["name", "unicode"]),
    # wrong types (strict: no coercion of strings, floats or bools into ints)
    ("type-count-string", "POST", "/alloc", {"session_id": "{A}", "num_blocks": "4"}, 422, ["num_blocks", "integer"]),
    ("type-count-float", "POST", "/alloc", {"session_id": "{A}", "num_blocks": 4.0}, 422, ["num_blocks", "integer"]),
    ("type-count-bool", "POST", "/alloc", {"session_id": "{A}", "num_blocks": True}, 422, ["num_blocks", "integer"]),
    ("type-count-null", "POST", "/alloc", {"session_id": "{A}", "num_blocks": None}, 422, ["num_blocks"]),
    ("type-ids-not-list", "POST", "/free", {"session_id": "{A}", "block_ids": 2}, 422, ["block_ids", "list"]),
    ("type-ids-strings", "POST", "/free", {"session_id": "{A}", "block_ids": ["2"]}, 422, ["block_ids"]),
    ("type-session-int", "POST", "/alloc", {"session_id": 7, "num_blocks": 1}, 422, ["session_id", "string"]),
    ("type-tokens-float", "POST", "/lookup", {"session_id": "{A}", "token_ids": [1.5]}, 422, ["token_ids"]),
    ("type-meta-string", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "r", "block_ids": [2], "num_tokens": 1, "meta": "x"}, 422, ["meta"]),
    ("type-role-unknown", "POST", "/sessions", {"name": "w", "role": "king"}, 422, ["role"]),
    ("type-name-empty", "POST", "/sessions", {"name": ""}, 422, ["name"]),
    ("missing-field", "POST", "/alloc", {"session_id": "{A}"}, 422, ["num_blocks", "missing"]),
    # unknown fields are refused, not ignored
    ("unknown-field", "POST", "/alloc", {"session_id": "{A}", "num_blocks": 1, "priority": 9}, 422,
     ["priority", "extra"]),
    ("unknown-field-free", "POST", "/free", {"session_id": "{A}", "block_ids": [2], "force": True}, 422, ["force"]),
    # unknown sessions
    ("unknown-session-alloc", "POST", "/alloc", {"session_id": "nope", "num_blocks": 1}, 404,
     ["unknown session", "malformed", "/sessions"]),
    ("unknown-session-free", "POST", "/free", {"session_id": "nope", "block_ids": [0]}, 404, ["unknown session"]),
    ("unknown-session-lookup", "POST", "/lookup", {"session_id": "nope", "token_ids": PREFIX}, 404,
     ["unknown session"]),
    ("unknown-session-claim", "POST", "/claim", {"session_id": "nope", "request_id": "parked"}, 404,
     ["unknown session"]),
    ("unknown-session-heartbeat", "POST", "/sessions/nope/heartbeat", None, 404, ["unknown session"]),
    ("unknown-session-close", "DELETE", "/sessions/nope", None, 404, ["unknown session"]),
    ("old-epoch-session", "POST", "/alloc", {"session_id": "0123abcd-00", "num_blocks": 1}, 404,
     ["another pool epoch"]),
    # handoffs
    ("handoff-request-taken", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "parked", "block_ids": [2], "num_tokens": 1}, 409, ["already parked"]),
    ("claim-unknown-request", "POST", "/claim", {"session_id": "{A}", "request_id": "nobody", "timeout_s": 0}, 404,
     ["nobody"]),
    ("handoff-no-blocks", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "r-none", "block_ids": [], "num_tokens": 0}, 400, ["at least one block"]),
    ("handoff-meta-too-large", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "r-meta", "block_ids": [2], "num_tokens": 1, "meta": {"x": "y" * 20000}},
     413, ["meta", "--max-meta-bytes"]),
    ("handoff-empty-request-id", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "", "block_ids": [2], "num_tokens": 1}, 422, ["request_id"]),
    ("handoff-to-nobody", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "r-to", "block_ids": [2], "num_tokens": 1, "to": "nobody"}, 400,
     ["no live session", "nobody"]),
    ("handoff-to-empty-name", "POST", "/handoff",
     {"session_id": "{A}", "request_id": "r-to2", "block_ids": [2], "num_tokens": 1, "to": ""}, 422, ["to"]),
    ("sessions-name-too-long", "GET", "/sessions?name=" + "x" * 200, None, 422, ["name"]),
    # the framework's own refusals keep the same error shape
    ("wrong-method", "GET", "/alloc", None, 405, ["Method Not Allowed"]),
    ("unknown-path", "POST", "/allocate", {"session_id": "{A}", "num_blocks": 1}, 404, ["Not Found"]),
]  # fmt: skip


def _fill(value: Any, world: World) -> Any:
    if isinstance(value, str):
        return value.replace("{A}", world.sa).replace("{B}", world.sb)
    if isinstance(value, list):
        return [_fill(v, world) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, world) for k, v in value.items()}
    return value


@pytest.mark.parametrize(("method", "path", "body", "status", "words"), [c[1:] for c in HTTP_CASES],
                         ids=[c[0] for c in HTTP_CASES])  # fmt: skip
def test_bad_http_request_is_a_4xx_with_detail_and_changes_nothing(
    world: World, method: str, path: str, body: Any, status: int, words: list[str]
) -> None:
    before = world.books()
    if isinstance(body, bytes):
        r = world.http.request(method, path, content=body, headers={"content-type": "application/json"})
    else:
        r = world.http.request(method, _fill(path, world), json=_fill(body, world))
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    detail = _detail_text(r.json())
    for word in words:
        assert word.lower() in detail.lower(), f"{word!r} not in detail {detail!r}"
    assert world.books() == before


def test_double_free_over_http_is_409_and_changes_nothing(world: World) -> None:
    """The first free succeeds (and moves the books); the second is refused and moves nothing."""
    (block,) = world.a.alloc(1)
    freed = world.http.post("/free", json={"session_id": world.sa, "block_ids": [block]})
    assert freed.status_code == 200 and freed.json() == {"freed": 1}
    before = world.books()
    again = world.http.post("/free", json={"session_id": world.sa, "block_ids": [block]})
    assert again.status_code == 409
    # the block went back to the free list, so its generation moved on: the id no longer names it
    body = again.json()
    assert body["error"] == "StaleBlock" and "stale" in body["detail"] and str(block) in body["detail"]
    assert body["stale_ids"] == [block]
    assert world.books() == before


def test_refused_batch_is_all_or_nothing(world: World) -> None:
    """A free listing one held and one foreign block frees neither: validation comes before any change."""
    before = world.books()
    r = world.http.post("/free", json={"session_id": world.sa, "block_ids": [2, 4]})
    assert r.status_code == 409
    assert world.books() == before
    # Block 2 is still A's: freeing it alone works.
    (block,) = world.a.alloc(1)
    assert world.a.free([block]) == 1


# -- the same through the fast channel ---------------------------------------------------------------------


def test_pool_client_takes_the_fast_channel(world: World) -> None:
    assert world.a.transport.fast_path is not None, "the fast channel is not in use, so the cases below would test HTTP"


FAST_CLIENT_CASES: list[tuple[str, Any, type[Exception], list[str]]] = [
    ("free-id-past-end", lambda w: w.a.free([64]), InvalidRequest, ["out of range"]),
    ("free-id-negative", lambda w: w.a.free([-5]), InvalidRequest, ["out of range"]),
    ("free-other-sessions-block", lambda w: w.a.free([4]), NotOwner, ["holds no reference"]),
    ("free-parked-block", lambda w: w.b.free([6]), NotOwner, ["holds no reference"]),
    ("free-same-block-twice", lambda w: w.a.free([3, 3]), NotOwner, ["listed more times"]),
    ("commit-other-sessions-block", lambda w: w.b.commit([2], [1, 2, 3, 4]), NotOwner, ["holds no reference"]),
    ("commit-token-negative", lambda w: w.a.commit([2], [1, 2, 3, -4]), InvalidRequest, ["token ids"]),
    ("handoff-other-sessions-block", lambda w: w.a.handoff("r-x", [5], 1), NotOwner, ["holds no reference"]),
    ("handoff-request-taken", lambda w: w.a.handoff("parked", [2], 1), HandoffExists, ["already parked"]),
    ("handoff-tokens-overflow", lambda w: w.a.handoff("r-y", [2], 5), InvalidRequest, ["does not fit"]),
    ("alloc-more-than-pool", lambda w: w.a.alloc(65), PoolExhausted, ["asked for 65"]),
    ("claim-unknown-request", lambda w: w.a.claim("nobody", timeout_s=0), HandoffNotFound, ["nobody"]),
    ("lookup-token-too-big", lambda w: w.a.lookup([2**32] * 4), InvalidRequest, ["token ids"]),
    ("handoff-to-nobody", lambda w: w.a.handoff("r-z", [2], 1, to="nobody"), InvalidRequest, ["no live session"]),
    ("free-packed-not-held", lambda w: w.a.free(array("i", [2, 5])), NotOwner, ["holds no reference", "5"]),
    ("handoff-no-blocks", lambda w: w.a.handoff("r-none", [], 0), InvalidRequest, ["at least one block"]),
    ("handoff-no-blocks-to", lambda w: w.a.handoff("r-none", [], 0, to="b"), InvalidRequest, ["at least one block"]),
    ("handoff-meta-too-large", lambda w: w.a.handoff("r-meta", [2], 1, meta={"x": "y" * 20000}), PayloadTooLarge,
     ["--max-meta-bytes"]),
]  # fmt: skip


@pytest.mark.parametrize(("call", "error", "words"), [c[1:] for c in FAST_CLIENT_CASES],
                         ids=[c[0] for c in FAST_CLIENT_CASES])  # fmt: skip
def test_bad_call_through_pool_client_fast_channel(world: World, call: Any, error: type[Exception],
                                                   words: list[str]) -> None:  # fmt: skip
    before = world.books()
    with pytest.raises(error) as info:
        call(world)
    for word in words:
        assert word in str(info.value)
    assert world.books() == before


def test_double_free_through_pool_client(world: World) -> None:
    (block,) = world.a.alloc(1)
    assert world.a.free([block]) == 1
    before = world.books()
    with pytest.raises(StaleBlock, match="stale") as refused:
        world.a.free([block])
    assert refused.value.stale == (block,)
    assert world.books() == before


def test_unknown_session_through_pool_client(world: World) -> None:
    """A client whose session is gone (closed here) gets UnknownSession, not a silent success."""
    c = PoolClient(world.pool.url, name="short-lived", heartbeat=False)
    try:
        assert c.transport.fast_path is not None
        world.http.delete(f"/sessions/{c.session_id}")
        before = world.books()
        with pytest.raises(UnknownSession, match="unknown session"):
            c.alloc(1)
        assert world.books() == before
    finally:
        c.close()


@pytest.fixture
def fast(world: World) -> Iterator[FastConnection]:
    """A raw fast-channel connection after hello: sends frames the client library would never build."""
    path = f"{world.pool.socket}.fast"
    conn = FastConnection(path, timeout_s=10)
    status, _ = conn.call(b"hello", b"{}")
    assert status == 200
    yield conn
    conn.close()


FAST_FRAME_CASES: list[tuple[str, bytes, Any, int, list[str]]] = [
    ("json-truncated", b"alloc", b'{"session_id": "x", "num_blocks": ', 422, ["json_invalid"]),
    ("json-empty", b"free", b"", 422, ["json_invalid"]),
    ("json-garbage", b"commit", b"\x00\x01\x02", 422, ["json_invalid"]),
    ("type-count-string", b"alloc", {"session_id": "{A}", "num_blocks": "4"}, 422, ["num_blocks", "int"]),
    ("type-count-float", b"alloc", {"session_id": "{A}", "num_blocks": 4.0}, 422, ["num_blocks", "int"]),
    ("type-ids-strings", b"free", {"session_id": "{A}", "block_ids": ["1"]}, 422, ["block_ids"]),
    ("alloc-zero", b"alloc", {"session_id": "{A}", "num_blocks": 0}, 422, ["num_blocks", "greater"]),
    ("alloc-negative", b"alloc", {"session_id": "{A}", "num_blocks": -1}, 422, ["num_blocks"]),
    ("alloc-past-schema", b"alloc", {"session_id": "{A}", "num_blocks": 2**40}, 422, ["num_blocks"]),
    ("unknown-field", b"alloc", {"session_id": "{A}", "num_blocks": 1, "priority": 1}, 422, ["priority", "extra"]),
    ("missing-field", b"lookup", {"session_id": "{A}"}, 422, ["token_ids", "missing"]),
    ("lookups-missing-field", b"lookups", {"session_id": "{A}"}, 422, ["lookups", "missing"]),
    ("lookups-token-too-big-in-second", b"lookups",
     {"session_id": "{A}", "lookups": [{"token_ids": PREFIX}, {"token_ids": [2**32, 1, 2, 3]}]}, 400, ["token ids"]),
    ("lookups-tokens-ragged-in-second", b"lookups",
     {"session_id": "{A}", "lookups": [{"tokens": "ZAAAAGUAAABmAAAAZwAAAA=="}, {"tokens": "AQID"}]}, 400, ["4-byte"]),
    ("commit-tokens-and-token-ids", b"commit",
     {"session_id": "{A}", "block_ids": [2], "token_ids": PREFIX, "tokens": "AQAAAA=="}, 422, ["not both"]),
    ("unknown-session", b"alloc", {"session_id": "nope", "num_blocks": 1}, 404, ["unknown session"]),
    ("unknown-op", b"format_disk", {"session_id": "{A}"}, 400, ["unknown op"]),
    ("id-past-end", b"free", {"session_id": "{A}", "block_ids": [64]}, 400, ["out of range"]),
    ("other-sessions-block", b"free", {"session_id": "{A}", "block_ids": [5]}, 409, ["holds no reference"]),
    ("lone-surrogate", b"handoff", b'{"session_id": "x", "request_id": "\\ud800", "block_ids": [], "num_tokens": 0}',
     422, ["json_invalid"]),
    # block ids attached packed (int64 after a NUL)
    ("ids-ragged", b"free", b'{"session_id": "x", "block_ids": []}\0\x01\x02\x03', 400, ["multiple of 8"]),
    ("ids-given-twice", b"free", ({"session_id": "{A}", "block_ids": [2]}, [3]), 400, ["given twice"]),
    ("ids-on-alloc", b"alloc", ({"session_id": "{A}", "num_blocks": 1}, [3]), 400, ["takes no block ids"]),
    ("ids-attached-past-end", b"free", ({"session_id": "{A}", "block_ids": []}, [64]), 400, ["out of range"]),
    ("ids-attached-not-held", b"free", ({"session_id": "{A}", "block_ids": []}, [5]), 409, ["holds no reference"]),
    ("accept-unknown-request", b"accept", {"session_id": "{A}", "request_id": "nobody"}, 404, ["nobody"]),
    # nested past any parser's depth, in a handoff (whose refusal is looked into for a request id to keep)
    ("json-too-deep", b"handoff", b'{"meta": ' + b"[" * 50000 + b"]" * 50000 + b"}", 422, ["recursion"]),
    ("json-too-deep-in-meta", b"handoff",
     b'{"session_id": "x", "request_id": "r", "to": "b", "block_ids": [2], "num_tokens": 0, "meta": {"a": '
     + b"[" * 50000 + b"]" * 50000 + b"}}", 422, ["recursion"]),
    ("handoff-no-blocks", b"handoff", {"session_id": "{A}", "request_id": "r-none", "block_ids": [], "num_tokens": 0},
     400, ["at least one block"]),
    ("handoff-no-blocks-attached", b"handoff",
     ({"session_id": "{A}", "request_id": "r-none", "block_ids": [], "num_tokens": 0}, []), 400,
     ["at least one block"]),
    ("handoff-meta-too-large", b"handoff",
     {"session_id": "{A}", "request_id": "r-meta", "block_ids": [2], "num_tokens": 1, "meta": {"x": "y" * 20000}},
     413, ["--max-meta-bytes"]),
]  # fmt: skip


@pytest.mark.parametrize(("op", "body", "status", "words"), [c[1:] for c in FAST_FRAME_CASES],
                         ids=[c[0] for c in FAST_FRAME_CASES])  # fmt: skip
def test_bad_fast_channel_frame(world: World, fast: FastConnection, op: bytes, body: Any, status: int,
                                words: list[str]) -> None:  # fmt: skip
    before = world.books()
    if isinstance(body, tuple):  # (JSON, block ids to attach packed)
        raw = json.dumps(_fill(body[0], world)).encode() + b"\0" + array("q", body[1]).tobytes()
    else:
        raw = body if isinstance(body, bytes) else json.dumps(_fill(body, world)).encode()
    got, reply = fast.call(op, raw)
    assert got == status, reply
    detail = _detail_text(json.loads(reply))
    for word in words:
        assert word.lower() in detail.lower(), f"{word!r} not in detail {detail!r}"
    assert world.books() == before
    # The connection survives a refused call: the next good one on it works.
    ok, _ = fast.call(b"heartbeat", json.dumps({"session_id": world.sa}).encode())
    assert ok == 200
