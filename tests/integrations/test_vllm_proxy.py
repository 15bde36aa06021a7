"""The prefill/decode proxy against two stand-in engines (no vLLM): what each engine is sent, what comes back."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from kvpool.integrations.vllm.proxy import build_app

HANDOFF = {"kvpool_handoff": "e1:cmpl-1", "kvpool_digest": "ab", "num_tokens": 32}


class Engines:
    def __init__(self, prefill_status: int = 200, params: dict | None = HANDOFF) -> None:
        self.seen: list[tuple[str, dict]] = []
        self.prefill_status, self.params = prefill_status, params

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.seen.append((request.url.host, body))
        if request.url.host == "prefill":
            if self.prefill_status != 200:
                return httpx.Response(self.prefill_status, json={"error": "prompt too long"})
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": self.params})
        if body.get("stream"):
            sse = {"content-type": "text/event-stream"}
            return httpx.Response(200, content=b"data: {}\n\ndata: [DONE]\n\n", headers=sse)
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})


def client(engines: Engines) -> TestClient:
    return TestClient(build_app("http://prefill", "http://decode", httpx.MockTransport(engines)))


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_each_request_is_prefilled_then_decoded_with_the_handoff(path: str) -> None:
    engines = Engines()
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 64, "temperature": 0}
    r = client(engines).post(path, json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    (h1, pre), (h2, dec) = engines.seen
    assert (h1, h2) == ("prefill", "decode")
    assert pre["max_tokens"] == 1 and pre["kv_transfer_params"] == {"do_remote_decode": True} and not pre["stream"]
    assert dec == {**body, "kv_transfer_params": HANDOFF}


def test_a_streamed_request_streams_the_decode_engines_answer() -> None:
    engines = Engines()
    r = client(engines).post("/v1/completions", json={"prompt": [1], "max_tokens": 8, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert "stream" not in engines.seen[0][1] or engines.seen[0][1]["stream"] is False
    assert engines.seen[1][1]["stream"] is True


def test_a_failed_prefill_is_the_clients_error_and_decode_is_not_asked() -> None:
    engines = Engines(prefill_status=400)
    r = client(engines).post("/v1/completions", json={"prompt": [1], "max_tokens": 8})
    assert r.status_code == 400 and r.json() == {"error": "prompt too long"}
    assert [h for h, _ in engines.seen] == ["prefill"]


def test_a_prefill_without_a_handoff_still_decodes_the_request_as_sent() -> None:
    engines = Engines(params=None)
    body = {"prompt": [1], "max_tokens": 8}
    assert client(engines).post("/v1/completions", json=body).status_code == 200
    assert engines.seen[1][1] == body


def test_a_body_that_is_not_a_json_object_is_refused_with_400() -> None:
    engines = Engines()
    r = client(engines).post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON object" in r.json()["detail"]
    assert engines.seen == []


@pytest.mark.parametrize("down", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_that_does_not_answer_gives_502_naming_it(down: str, stream: bool) -> None:
    engines = Engines()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == down:
            raise httpx.ConnectError("All connection attempts failed", request=request)
        return engines(request)

    app = build_app("http://prefill", "http://decode", httpx.MockTransport(handler))
    r = TestClient(app).post("/v1/completions", json={"prompt": [1], "max_tokens": 8, "stream": stream})
    assert r.status_code == 502
    assert r.json()["detail"].startswith(f"the {down} engine at http://{down} did not answer (ConnectError: All conn")
