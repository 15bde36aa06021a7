"""/metrics: what Prometheus' own tooling accepts, parsed with prometheus-client and held to promtool's rules."""

from __future__ import annotations

import re

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from kvpool.client import PoolClient
from kvpool.layout import KVLayout
from tests.conftest import LocalPool

OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"
NAME = re.compile(r"[a-z_][a-z0-9_]*")
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")


def exercise(pool: LocalPool) -> None:
    with PoolClient(pool.url, name="metrics", role="other", layout=LAYOUT) as client:
        ids = client.alloc(3)
        client.commit(ids, list(range(12)))
        client.free(ids)
        client.free(client.lookup(list(range(12))).block_ids)
    with PoolClient(pool.url, name="metrics-http", role="other", layout=LAYOUT, fast=False) as client:
        client.free(client.alloc(1))


def promtool_problems(text: str) -> list[str]:
    """The naming rules ``promtool check metrics`` enforces, on the classic text format."""
    problems = []
    for family in text_string_to_metric_families(text):
        name = family.name
        if not NAME.fullmatch(name):
            problems.append(f"{name}: not snake_case (colons are for recording rules)")
        if not family.documentation:
            problems.append(f"{name}: no help text")
        if family.type == "counter":
            if not all(s.name.endswith(("_total", "_created")) for s in family.samples):
                problems.append(f"{name}: counter samples must end in _total")
        elif name.endswith("_total") or any(s.name.endswith("_total") for s in family.samples):
            problems.append(f"{name}: a {family.type} must not end in _total")
        if re.search(r"_(milliseconds|microseconds|ms|us|bytes_total_bytes)$", name):
            problems.append(f"{name}: use base units (seconds, bytes)")
        for sample in family.samples:
            for label in sample.labels:
                if not NAME.fullmatch(label):
                    problems.append(f"{name}: label {label} not snake_case")
    return problems


def test_metrics_pass_promtools_naming_rules(pool_server: LocalPool) -> None:
    exercise(pool_server)
    with pool_server.http() as http:
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert promtool_problems(r.text) == []
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert families["kvpool_arena_blocks"].type == "gauge"
    assert families["kvpool_arena_blocks"].samples[0].value == 64
    by_state = {s.labels["state"]: s.value for s in families["kvpool_blocks"].samples}
    assert sum(by_state.values()) == 64


def test_each_operation_has_a_latency_histogram(pool_server: LocalPool) -> None:
    exercise(pool_server)
    with pool_server.http() as http:
        text = http.get("/metrics").text
    (histogram,) = [f for f in text_string_to_metric_families(text) if f.name == "kvpool_operation_duration_seconds"]
    assert histogram.type == "histogram"
    counts = {s.labels["operation"]: s.value for s in histogram.samples if s.name.endswith("_count")}
    # both clients: the fast channel's calls and the HTTP ones land in the same histograms
    assert counts["alloc"] == 2 and counts["free"] == 3 and counts["commit"] == 1 and counts["lookup"] == 1
    assert counts["open_session"] == 2 and counts["close_session"] == 2
    sums = {s.labels["operation"]: s.value for s in histogram.samples if s.name.endswith("_sum")}
    assert 0 < sums["alloc"] < 10


def test_openmetrics_when_the_scraper_asks_for_it(pool_server: LocalPool) -> None:
    exercise(pool_server)
    with pool_server.http() as http:
        r = http.get("/metrics", headers={"accept": OPENMETRICS})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_families(r.text)}
    assert families["kvpool_alloc_requests"].type == "counter"
    assert families["kvpool_alloc_requests"].samples[0].name == "kvpool_alloc_requests_total"
    assert families["kvpool_operation_duration_seconds"].type == "histogram"
