"""A prefill/decode proxy for two ``vllm serve`` engines that share a kvpool pool (as vLLM's disaggregated examples).

    python -m kvpool.integrations.vllm.proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Each OpenAI completion or chat request goes to the prefill engine with one token to generate and
``kv_transfer_params: {"do_remote_decode": true}``; the connector there parks the prompt's KV in the pool and the
answer names the handoff. The request then goes, unchanged but for that handoff, to the decode engine, whose
connector claims it; its answer (streamed or not) is the client's. A prefill that fails is the client's error;
a prefill answer without a handoff still goes on to decode, which then computes the prompt itself. An engine that
does not answer (still loading its model, or stopped) gives 502 with a JSON body naming it.

Engines on two nodes, each with its own pool: ``--prefill-pool`` names the prefill engine's pool as the decode
engine's pool lists it in ``--peers``, and the decode engine claims the handoff through its own pool, which reads
the blocks from the peer (docs/across-nodes.md).
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvpool.integrations.vllm.remote import PEER_KEY

PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
    out.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    return out


def unreachable(engine: str, url: str, exc: httpx.TransportError) -> JSONResponse:
    """502 naming the engine: an engine that is still loading its model, or stopped, is the usual cause."""
    why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    detail = (
        f"the {engine} engine at {url} did not answer ({why}): `vllm serve` listens only once its model is loaded,"
        f" so wait for its 'Application startup complete', or read its log for why it stopped"
    )
    return JSONResponse({"detail": detail}, 502)


def build_app(
    prefill: str, decode: str, transport: httpx.AsyncBaseTransport | None = None, prefill_pool: str | None = None
) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), transport=transport)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="kvpool prefill/decode proxy", lifespan=lifespan)

    async def relay(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"detail": "the body is not JSON: send an OpenAI completion request"}, 400)
        if not isinstance(body, dict):
            return JSONResponse({"detail": "the body must be a JSON object (an OpenAI completion request)"}, 400)
        path = request.url.path
        try:
            pre = await client.post(prefill + path, json=prefill_body(body))
        except httpx.TransportError as exc:
            return unreachable("prefill", prefill, exc)
        if pre.status_code != 200:
            return Response(pre.content, pre.status_code, media_type=pre.headers.get("content-type"))
        params = pre.json().get("kv_transfer_params")
        if params and prefill_pool:
            params = {**params, PEER_KEY: prefill_pool}
        dec = {**body, "kv_transfer_params": params} if params else body
        try:
            if not body.get("stream"):
                r = await client.post(decode + path, json=dec)
                return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
            upstream = await client.send(client.build_request("POST", decode + path, json=dec), stream=True)
        except httpx.TransportError as exc:
            return unreachable("decode", decode, exc)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_bytes():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(chunks(), upstream.status_code, media_type=upstream.headers.get("content-type"))

    for path in PATHS:
        app.add_api_route(path, relay, methods=["POST"])

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Send each request to a prefill engine, then to a decode engine.")
    ap.add_argument("--prefill", required=True, help="the prefill engine's base URL, e.g. http://127.0.0.1:8100")
    ap.add_argument("--decode", required=True, help="the decode engine's base URL, e.g. http://127.0.0.1:8200")
    ap.add_argument("--prefill-pool", help="the prefill engine's pool, as the decode engine's pool lists it in "
                    "--peers, where the two engines use different pools (other nodes)")  # fmt: skip
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    import uvicorn

    pool = args.prefill_pool.rstrip("/") if args.prefill_pool else None
    app = build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), prefill_pool=pool)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
