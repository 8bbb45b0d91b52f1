"""`kvtier route`'s front door: an OpenAI-compatible app that forwards each request to one replica.

A request is read once, tokenized once (`prompts.py`), handed to the selector with the replicas in
service, and forwarded as it came. The replica's status, body and content type come back unchanged;
a stream (SSE) is passed through chunk by chunk as it arrives. A replica that refuses the connection or
answers 5xx is taken out (`replicas.py` back-off) and the request goes to another replica not yet tried;
only when every replica has failed it does the client see the last 5xx (or a 503 when none answered).
A body the router cannot read is still forwarded: the replica's 400 is the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.route.metrics import RouteMetrics
from kvtier.route.prompts import prompt_token_ids, request_cache_salt
from kvtier.route.replicas import Replica, ReplicaSet
from kvtier.route.selectors import Choice, LeastLoaded, Selector, SelectorError

log = logging.getLogger("kvtier.route")

_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                "accept-encoding", "proxy-authorization", "proxy-connection", "trailer"}
_KEPT_REPLY_HEADERS = ("content-type", "x-request-id")
REPLICA_HEADER = "x-kvtier-replica"  # which replica answered


class Router:
    """The replicas, the selector and the metrics one app serves with."""

    def __init__(self, replicas: ReplicaSet, selector: Selector, *, tokenizer=None, timeout_s: float = 600.0,
                 connect_timeout_s: float = 5.0) -> None:
        self.replicas = replicas
        self.selector = selector
        self.fallback = LeastLoaded()
        self.tokenizer = tokenizer
        self.metrics = RouteMetrics([r.name for r in replicas.replicas])
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))
        self.selector_down = False
        self.event_relay = None  # `event_relay.EventRelay`: the replicas' KV events to the selector; closed with it

    async def start(self) -> None:
        await self.selector.start()

    async def close(self) -> None:
        await self.client.aclose()
        await self.selector.close()
        if self.event_relay is not None:
            self.event_relay.close()

    async def choose(self, token_ids: list[int] | None, candidates: list[Replica], *,
                     cache_salt: str | None = None) -> tuple[Choice, str]:
        """The selector's choice and its policy; least-loaded's while the selector does not answer."""
        try:
            choice = await self.selector.choose(token_ids, candidates, cache_salt=cache_salt)
        except SelectorError as exc:
            if not self.selector_down:  # once per outage
                log.warning("kvtier route: the %s selector is unavailable (%s); least-loaded chooses until it "
                            "answers again", self.selector.policy, exc)
                self.selector_down = True
            self.metrics.fallbacks.inc()
            return await self.fallback.choose(token_ids, candidates), self.fallback.policy
        if self.selector_down:
            log.warning("kvtier route: the %s selector answers again", self.selector.policy)
            self.selector_down = False
        return choice, choice.policy or self.selector.policy

    def _take_out(self, replica: Replica, reason: str) -> None:
        backoff_s = self.replicas.take_out(replica)
        self.metrics.retries.labels(replica.name, reason).inc()
        self.metrics.up.labels(replica.name).set(0)
        log.warning("kvtier route: replica %s taken out for %.1f s (%s); its request goes to another",
                    replica.name, backoff_s, reason)

    def _started(self, replica: Replica) -> None:
        replica.num_in_flight += 1
        replica.num_requests += 1
        self.metrics.in_flight.labels(replica.name).set(replica.num_in_flight)

    def _ended(self, replica: Replica) -> None:
        replica.num_in_flight -= 1
        self.metrics.in_flight.labels(replica.name).set(replica.num_in_flight)

    async def forward(self, request: Request, path: str) -> Response:
        body = await request.body()
        token_ids, salt = await self._routing_key(path, body)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        headers["accept-encoding"] = "identity"  # bytes pass through as they come, never re-encoded
        upstream_request = (request.method, path, request.query_params, headers, body)
        tried: set[int] = set()
        last_failure: Response | None = None
        while candidates := self.replicas.available(exclude=tried):
            choice, policy = await self.choose(token_ids, candidates, cache_salt=salt)
            tried.add(choice.replica.replica_id)
            reply, failure = await self._send(upstream_request, choice, policy)
            if reply is not None:
                return reply
            last_failure = failure or last_failure
        if last_failure is not None:
            return last_failure
        return JSONResponse({"error": {"message": "kvtier route: no replica is in service (all taken out)",
                                       "type": "service_unavailable", "code": 503}}, status_code=503)

    async def _routing_key(self, path: str, body: bytes) -> tuple[list[int] | None, str | None]:
        """(the prompt's token ids, its cache_salt): once per request, retries included; off the event loop
        (a long prompt takes a while)."""
        if path not in _GENERATION_PATHS or self.tokenizer is None:
            return None, None
        try:
            request = json.loads(body)
        except ValueError:  # not JSON: the replica says so
            return None, None
        return await asyncio.to_thread(prompt_token_ids, self.tokenizer, path, request), request_cache_salt(request)

    async def _send(self, upstream_request: tuple, choice: Choice, policy: str) -> tuple[Response | None,
                                                                                          Response | None]:
        """(the reply to pass through, None), or (None, the replica's 5xx or None) when it failed."""
        method, path, params, headers, body = upstream_request
        replica = choice.replica
        self._started(replica)
        try:
            upstream = await self.client.send(self.client.build_request(
                method, replica.url.rstrip("/") + path, params=params, headers=headers, content=body), stream=True)
        except httpx.TransportError as exc:
            await self._failed(replica, choice, f"unreachable: {type(exc).__name__}")
            return None, None
        streamed = upstream.headers.get("content-type", "").startswith("text/event-stream")
        content = b""
        if upstream.status_code >= 500 or not streamed:  # a whole body: a replica dying in it is retried
            try:
                content = await upstream.aread()
            except httpx.TransportError as exc:
                await self._failed(replica, choice, f"unreachable: {type(exc).__name__}")
                return None, None
            finally:
                await upstream.aclose()
        reply_headers = _reply_headers(upstream, replica)
        if upstream.status_code >= 500:
            await self._failed(replica, choice, f"answered {upstream.status_code}")
            return None, Response(content, upstream.status_code, headers=reply_headers)
        if self.replicas.succeeded(replica):
            self.metrics.up.labels(replica.name).set(1)
            log.warning("kvtier route: replica %s is back in service", replica.name)
        if streamed:
            return self._stream_through(upstream, choice, policy), None
        await self.selector.first_bytes(choice)
        await self._release(replica, choice)
        self._count(replica, policy, choice, upstream.status_code, _usage_of_json(content))
        return Response(content, upstream.status_code, headers=reply_headers), None

    async def _failed(self, replica: Replica, choice: Choice, reason: str) -> None:
        await self._release(replica, choice)
        self._take_out(replica, reason)

    async def _release(self, replica: Replica, choice: Choice) -> None:
        self._ended(replica)
        await self.selector.finished(choice)

    def _count(self, replica: Replica, policy: str, choice: Choice, code: int, usage: dict | None) -> None:
        m = self.metrics
        m.requests.labels(replica.name, policy, str(code)).inc()
        for tier, tokens in choice.matched_tokens.items():
            m.matched_tokens.labels(replica.name, policy, tier).inc(tokens)
        if usage:
            m.prompt_tokens.labels(replica.name, policy).inc(usage.get("prompt_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            m.cached_tokens.labels(replica.name, policy).inc(details.get("cached_tokens") or 0)

    def _stream_through(self, upstream: httpx.Response, choice: Choice, policy: str) -> StreamingResponse:
        """SSE chunk by chunk as it arrives; a replica dying mid-stream ends the stream (its bytes went out)."""
        replica = choice.replica

        async def chunks():
            usage = _SseUsage()
            first = True
            try:
                async for chunk in upstream.aiter_raw():
                    if first:
                        first = False
                        await self.selector.first_bytes(choice)
                    usage.feed(chunk)
                    yield chunk
            finally:
                await upstream.aclose()
                await self._release(replica, choice)
                self._count(replica, policy, choice, upstream.status_code, usage.usage)

        return StreamingResponse(chunks(), upstream.status_code, headers=_reply_headers(upstream, replica))


def _reply_headers(upstream: httpx.Response, replica: Replica) -> dict[str, str]:
    headers = {k: upstream.headers[k] for k in _KEPT_REPLY_HEADERS if k in upstream.headers}
    headers[REPLICA_HEADER] = replica.name
    return headers


def _usage_of_json(content: bytes) -> dict | None:
    try:
        usage = json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


class _SseUsage:
    """The last `usage` an SSE stream carried (`stream_options.include_usage`), read as lines complete."""

    def __init__(self) -> None:
        self._partial = b""
        self.usage: dict | None = None

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if line.startswith(b"data:") and b'"usage"' in line:
                found = _usage_of_json(line[5:].strip())
                if found:
                    self.usage = found


def create_app(router: Router) -> FastAPI:
    """The router's app: the generation endpoints routed by the selector, any other `/v1/` request to a
    replica in service, and `/metrics` and `/health` of its own."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.close()

    app = FastAPI(title="kvtier route", lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health():
        in_service = router.replicas.available()
        return JSONResponse({"replicas_in_service": len(in_service)}, status_code=200 if in_service else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def v1(request: Request, rest: str):
        return await router.forward(request, "/v1/" + rest)

    return app
