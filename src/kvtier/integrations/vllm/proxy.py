"""Prefill/decode disaggregation through kvtier's tiers: a small OpenAI-compatible proxy in front of two vLLMs.

vLLM's wheel ships no disaggregation proxy (only examples in its repository), so this is kvtier's:
each completion goes first to the prefill vLLM (`kv_role: kv_producer`) with `max_tokens: 1` — it computes
the prompt and, before answering, writes every full block down the shared tiers (Mooncake, Redis, `shm:`)
— then, unchanged, to the decode vLLM (`kv_consumer`), which loads those blocks and computes only the tail.
A prefill that fails (the producer killed, overloaded) is logged and counted, never returned: the consumer
then computes the prompt itself.

    python -m kvtier.integrations.vllm.proxy --prefill http://HOST:PORT --decode http://HOST:PORT --port 8000
"""

from __future__ import annotations

import argparse
import logging
import threading
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.thread_names import named_thread

log = logging.getLogger("kvtier.proxy")
ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: dict) -> dict:
    """The producer's request: the same prompt, one token, not streamed."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class ProxyStats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.prefills = 0
        self.prefill_failures = 0
        self.prefill_seconds = 0.0


def create_app(prefill_url: str, decode_url: str, *, prefill_timeout_s: float = 600) -> FastAPI:
    app = FastAPI(title="kvtier disaggregation proxy")
    stats = app.state.stats = ProxyStats()
    prefill = httpx.AsyncClient(base_url=prefill_url, timeout=prefill_timeout_s)
    decode = httpx.AsyncClient(base_url=decode_url, timeout=None)

    async def forward(path: str, request: Request) -> Response:
        body = await request.json()
        start = time.perf_counter()
        try:
            reply = await prefill.post(path, json=prefill_body(body))
            reply.raise_for_status()
            failed = False
        except Exception as exc:  # noqa: BLE001 - a lost prefill costs time, never a request
            log.warning("prefill of %s failed (%s); the decode server computes the prompt", path, exc)
            failed = True
        with stats.lock:
            stats.prefills += 1
            stats.prefill_failures += failed
            stats.prefill_seconds += time.perf_counter() - start
        if body.get("stream"):
            upstream = await decode.send(decode.build_request("POST", path, json=body), stream=True)
            return StreamingResponse(upstream.aiter_raw(), status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type"),
                                     background=_Close(upstream))
        reply = await decode.post(path, json=body)
        return Response(reply.content, status_code=reply.status_code, media_type=reply.headers.get("content-type"))

    for route in ROUTES:
        app.add_api_route(route, _bind(forward, route), methods=["POST"])

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"ok": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        """The decode server's metrics (where the requests' replies come from)."""
        reply = await decode.get("/metrics")
        return Response(reply.content, media_type=reply.headers.get("content-type"))

    @app.get("/proxy/stats")
    async def proxy_stats() -> JSONResponse:
        with stats.lock:
            return JSONResponse({"prefills": stats.prefills, "prefill_failures": stats.prefill_failures,
                                 "prefill_seconds": stats.prefill_seconds})

    return app


def _bind(forward, path: str):
    async def route(request: Request) -> Response:
        return await forward(path, request)
    return route


class _Close:
    """Background task closing the upstream stream once the response is sent."""

    def __init__(self, upstream: httpx.Response) -> None:
        self.upstream = upstream

    async def __call__(self) -> None:
        await self.upstream.aclose()


class ProxyThread:
    """The proxy on a free 127.0.0.1 port, served by a thread of this process: product code, used by
    `kvtier bench vllm`'s disaggregated system (`bench.servers.DisaggSystem`) and the tests."""

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        import uvicorn

        from kvtier.ports import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = create_app(prefill_url, decode_url)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = named_thread(self.server.run, "kvtier-proxy")

    def __enter__(self) -> ProxyThread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the disaggregation proxy did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def stats(self) -> dict:
        with self.app.state.stats.lock:
            s = self.app.state.stats
            return {"prefills": s.prefills, "prefill_failures": s.prefill_failures, "prefill_seconds": s.prefill_seconds}


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", required=True, help="the kv_producer vLLM's URL")
    parser.add_argument("--decode", required=True, help="the kv_consumer vLLM's URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(create_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
