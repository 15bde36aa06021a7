"""Schemathesis against a real pool's served ``/openapi.json``: every operation, over a thousand cases.

The cases come from schemathesis's hypothesis strategies, run by plain ``@given``: its pytest plugin reaches
into pytest's internals, which change between pytest releases.

What must hold for any input: no 5xx (except 507 "pool exhausted" from ``/alloc``, which the contract names),
every response conforms to the schema (status code, content type, headers, body), schema-invalid requests are
refused with a 4xx, and afterwards the books balance with nothing left in use.

Random session ids only ever reach "unknown session"; to get past that door, half of the cases that carry a
session id are steered onto a live session, so alloc, free, commit, lookup, handoff and claim run their real
logic on random ids and counts. Steered waits and time-to-lives are clamped so the run stays short.

``positive_data_acceptance`` is left out on purpose: the protocol is stricter than JSON Schema (``2.0`` is a
valid JSON Schema integer but a strict request refuses it) and a schema-valid block id is usually not one the
session holds (a 409 by design), so "valid per the schema" does not mean "must succeed" here.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error, positive_data_acceptance

from tests.conftest import SMALL_POOL, PoolProcess, start_pool
from tests.server.balance import assert_balanced

MAX_EXAMPLES = 110  # per operation and generation mode; 9 operations take input, so well over 1000 cases
MIN_CASES = 1000

pytestmark = pytest.mark.slow  # deselect with -m 'not slow'
CASES: Counter[str] = Counter()
STATUSES: Counter[tuple[str, int]] = Counter()


class LiveSession:
    """A real session that steered cases use; renewed when a case closes it or it holds too much."""

    def __init__(self, pool: PoolProcess) -> None:
        self.http = pool.http()
        self.pool = pool
        self.steered = 0
        self.session_id = self._open()

    def _open(self) -> str:
        r = self.http.post("/sessions", json={"name": "fuzz-live", "role": "other"})
        assert r.status_code == 200, r.text
        return str(r.json()["session_id"])

    def renew(self) -> None:
        self.http.delete(f"/sessions/{self.session_id}")
        self.session_id = self._open()

    def steer(self, case: schemathesis.Case) -> None:
        """Point every other case that names a session at the live one, with short waits and lifetimes.

        Only a session id that is itself valid is replaced: in a negative case that breaks the session id, the
        replacement would mend the very thing the case means to break.
        """
        body = case.body if isinstance(case.body, dict) else None
        sid = body.get("session_id") if body is not None else None
        names_session = (isinstance(sid, str) and len(sid) <= 64) or "session_id" in (case.path_parameters or {})
        if not names_session:
            return
        self.steered += 1
        if self.steered % 2:
            return
        if self.steered % 64 == 0:
            self.renew()
        if body is not None:
            body["session_id"] = self.session_id
            # Clamp only values the schema allows (a value past its maximum is what a negative case tests).
            for key, cap, schema_max in (("timeout_s", 0.05, 3600), ("ttl_s", 0.5, 86400)):
                value = body.get(key)
                if isinstance(value, int | float) and not isinstance(value, bool) and cap < value <= schema_max:
                    body[key] = cap
        else:
            case.path_parameters["session_id"] = self.session_id
        if case.method.upper() == "DELETE":
            self.session_id = ""  # it is closed by this case; the next steer opens another

    def ensure(self) -> None:
        if not self.session_id:
            self.session_id = self._open()

    def close(self) -> None:
        if self.session_id:
            self.http.delete(f"/sessions/{self.session_id}")
        self.http.close()


@pytest.fixture(scope="module")
def fuzz_pool() -> Iterator[PoolProcess]:
    # Short handoff and lease lives: whatever the fuzzer parks or leaves open is gone soon after the run.
    pool = start_pool(*SMALL_POOL, "--handoff-ttl-s", "1", "--lease-ttl-s", "2")
    yield pool
    pool.stop()


@pytest.fixture(scope="module")
def live(fuzz_pool: PoolProcess) -> Iterator[LiveSession]:
    session = LiveSession(fuzz_pool)
    yield session
    session.close()


@pytest.fixture(scope="module")
def http_session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(fuzz_pool: PoolProcess) -> Any:
    return schemathesis.openapi.from_url(f"{fuzz_pool.tcp_url}/openapi.json")


def _check(case: schemathesis.Case, live: LiveSession, http_session: requests.Session) -> None:
    live.ensure()
    live.steer(case)
    response = case.call(session=http_session, timeout=10)
    label = case.operation.label
    CASES[label] += 1
    STATUSES[(label, response.status_code)] += 1
    if response.status_code >= 500:
        exhausted = label == "POST /alloc" and response.status_code == 507
        assert exhausted, f"{label} answered {response.status_code}: {response.text[:500]}"
        assert response.json()["error"] == "PoolExhausted"
    content_type = (response.headers.get("content-type") or [""])[0]  # schemathesis keeps a list per header
    if 400 <= response.status_code < 500 and content_type.startswith("application/json"):
        assert "detail" in response.json(), f"{label} {response.status_code} without a detail: {response.text[:300]}"
    case.validate_response(response, excluded_checks=[positive_data_acceptance, not_a_server_error])


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
def test_fuzz_every_operation(
    mode: GenerationMode, api_schema: Any, live: LiveSession, http_session: requests.Session
) -> None:
    """Each operation's cases come from schemathesis's own strategy, run by plain hypothesis (no pytest plugin)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert operations, "the served schema lists no operations"
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            print_blob=True,
        )
        def fuzz(case: schemathesis.Case) -> None:
            _check(case, live, http_session)

        try:
            fuzz()
        except Unsatisfiable:
            if mode is GenerationMode.POSITIVE:  # an operation without parameters has no negative cases
                raise


def test_fuzz_covered_every_operation_and_left_the_books_clean(fuzz_pool: PoolProcess, live: LiveSession) -> None:
    """Runs after the fuzz above (file order): the case count, the coverage, and the books after it all."""
    if not CASES:
        pytest.skip("the fuzz test did not run in this session (deselected)")
    with httpx.Client(base_url=fuzz_pool.tcp_url) as h:
        paths = h.get("/openapi.json").json()["paths"]
    operations = {f"{method.upper()} {path}" for path, item in paths.items() for method in item}
    assert operations - set(CASES) == set(), f"operations never fuzzed: {operations - set(CASES)}"
    total = sum(CASES.values())
    print(f"\nfuzz: {total} cases; by operation {dict(CASES)}; statuses {dict(STATUSES)}")
    assert total >= MIN_CASES, f"only {total} fuzz cases ran"
    # The steered cases must have reached past "unknown session": calls on block ids succeeded on the live one.
    block_ops = ("POST /alloc", "POST /free", "POST /commit", "POST /lookup", "POST /handoff", "POST /claim")
    assert sum(STATUSES[(op, 200)] for op in block_ops) > 0, STATUSES
    live.close()
    live.session_id = ""
    deadline = time.monotonic() + 5
    stats = fuzz_pool.stats()
    while (stats["in_use"] or stats["handoffs"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = fuzz_pool.stats()
    assert_balanced(stats)
    assert stats["in_use"] == 0, stats
    assert stats["handoffs"] == 0, stats
    assert "Traceback" not in fuzz_pool.output(), fuzz_pool.output()[-3000:]
