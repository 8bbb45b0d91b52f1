"""The FastAPI app: OpenAI's /v1/completions and /v1/chat/completions (JSON or SSE), /v1/models,
/health, /metrics (Prometheus) and a small live dashboard, in front of one `AsyncEngine`.

Every bad request is answered with a 4xx and an OpenAI-style error body before it reaches the
engine (any body the JSON parser rejects, too deep or with a huge integer included; a body cut
short by the client is dropped quietly); a request that fails or whose client goes away — streaming
or not — is aborted in the engine alone. `max_tokens` beyond what fits is rejected
(`context_length_exceeded`), never clamped.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, fields
from importlib import resources

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kvtier.engine import AsyncEngine, ContextLengthError, EngineDeadError, RequestFailedError, SamplingParams
from kvtier.engine.engine import HostRoomError
from kvtier.server import protocol
from kvtier.server.generation import EngineAbortedError, Generation
from kvtier.server.metrics import CONTENT_TYPE, EngineView, ServerMetrics

_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


class BadRequest(Exception):
    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status


class ClientGone(Exception):
    """The client went away before the request was answered (its engine request, if any, is aborted)."""


@dataclass(slots=True)
class ServerState:
    engine: AsyncEngine
    tokenizer: object
    model_name: str
    metrics: ServerMetrics
    vocab_size: int
    created: int
    trace: object | None = None         # a sim.trace.TraceRecorder: finished requests, Mooncake format
    started_perf: float = 0.0          # time.perf_counter() at start: trace timestamps count from it


def engine_view(async_engine: AsyncEngine) -> EngineView:
    stats = async_engine.engine.stats()
    return EngineView(**{f.name: getattr(stats, f.name) for f in fields(EngineView)})


def create_app(async_engine: AsyncEngine, tokenizer, model_name: str, *, manager=None,
               on_shutdown=None, record_trace=None) -> FastAPI:
    """`on_shutdown()` runs after the engine thread stopped (flush blocks, close the tiers).
    `record_trace`: a JSONL path; every finished request is appended in the Mooncake trace format
    (`kvtier simulate` replays it)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.shutdown()
        if on_shutdown is not None:
            on_shutdown()
        if state.trace is not None:
            state.trace.close()

    app = FastAPI(title="kvtier", lifespan=lifespan)
    vocab_size = int(async_engine.engine.runner.lm_head.out_features)
    state = ServerState(async_engine, tokenizer, model_name,
                        ServerMetrics(lambda: engine_view(async_engine), manager), vocab_size, int(time.time()),
                        started_perf=time.perf_counter())
    if record_trace is not None:
        from kvtier.sim.trace import TraceRecorder

        state.trace = TraceRecorder(record_trace)
    app.state.kvtier = state
    _add_error_handlers(app, state)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _error(state: ServerState, status: int, message: str, *, type_: str | None = None, param=None, code=None):
    state.metrics.observe_error(status)
    type_ = type_ or ("invalid_request_error" if status < 500 else "server_error")
    return JSONResponse(protocol.error_body(message, type=type_, param=param, code=code), status_code=status)


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        return _error(state, exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        state.metrics.observe_error(499)
        return Response(status_code=499)  # nginx's "client closed request"; never delivered

    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, exc: RequestValidationError):
        return _error(state, 400, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(state, exc.status_code, str(exc.detail), type_="not_found_error" if exc.status_code == 404 else None)


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return protocol.model_list(state.model_name, state.created)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return resources.files("kvtier.server").joinpath("static/dashboard.html").read_text()

    @app.get("/dashboard/data")
    async def dashboard_data():
        return {"model": state.model_name, **state.metrics.snapshot()}


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel:
    try:
        body = await request.body()
    except ClientDisconnect:  # a truncated body, bad chunked encoding: the server closed the connection
        raise ClientGone() from None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limit, depth
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise BadRequest(f"the request body is not valid JSON: {reason}") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param(err["loc"])
        raise BadRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after"}


def _param(loc: tuple) -> str | None:
    """`messages.0.role` from pydantic's loc, without its union-member tags (`constrained-str`, `list[...]`)."""
    parts = [str(p) for i, p in enumerate(loc)
             if i == 0 or isinstance(p, int) or (str(p).isidentifier() and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


def _sampling(state: ServerState, req, num_prompt_tokens: int, max_tokens: int | None, *,
              default_max_tokens: int | None = None) -> SamplingParams:
    """`max_tokens` None: `default_max_tokens`, or as much as the context and the device budget allow
    (only a default is fitted to the room left; an explicit max_tokens that does not fit is rejected)."""
    engine = state.engine.engine
    prompt_param = "messages" if hasattr(req, "messages") else "prompt"
    if max_tokens is None:
        room = max(1, engine.request_token_limit(req.kv_offload) - num_prompt_tokens)
        max_tokens = min(default_max_tokens or room, room)
    try:
        engine.check_request(num_prompt_tokens, max_tokens, req.kv_offload)
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                              kv_offload=req.kv_offload)
    except HostRoomError as exc:  # an offloaded request's host blocks: never (400) or not now (429)
        raise BadRequest(str(exc), param=_max_tokens_param(req), code="host_memory_exhausted",
                         status=429 if exc.ever else 400) from None
    except ContextLengthError as exc:
        param = prompt_param if exc.param == "prompt" else _max_tokens_param(req)
        raise BadRequest(str(exc), param=param, code="context_length_exceeded") from None
    except ValueError as exc:
        raise BadRequest(str(exc), param=prompt_param) from None


def _max_tokens_param(req) -> str:
    return "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        started_at = time.perf_counter()
        req = await _parse(request, protocol.CompletionRequest)
        if isinstance(req.prompt, str):
            prompt_ids = list(state.tokenizer.encode(req.prompt))
        else:
            prompt_ids = list(req.prompt)
            if max(prompt_ids) >= state.vocab_size:
                raise BadRequest(f"token id {max(prompt_ids)} is outside the vocabulary ({state.vocab_size})",
                                 param="prompt")
        sampling = _sampling(state, req, len(prompt_ids), req.max_tokens, default_max_tokens=_DEFAULT_COMPLETION_TOKENS)
        gen = _generation(state, "cmpl", req, prompt_ids, sampling, started_at)
        return await _respond(state, request, gen, req, _completion_events, protocol.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        started_at = time.perf_counter()
        req = await _parse(request, protocol.ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt_ids = _as_ids(state.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        except Exception as exc:  # noqa: BLE001 — a template that rejects these messages
            raise BadRequest(f"the chat template rejected the messages: {exc}", param="messages") from None
        gen = _generation(state, "chatcmpl", req, prompt_ids,
                          _sampling(state, req, len(prompt_ids), req.token_limit()), started_at)
        return await _respond(state, request, gen, req, _chat_events, protocol.chat_completion)


async def _respond(state: ServerState, request: Request, gen: Generation, req, events, body):
    """SSE of `events(state, gen, req)` when streaming, else the whole text in `body(...)`."""
    if req.stream:
        return _sse(events(state, gen, req))
    text = await _collect(state, request, gen)
    if isinstance(text, Response):
        return text
    result = body(gen.request_id, state.model_name, text, gen.finish_reason, gen.usage())
    if gen.offload is not None:  # longer than the device: what its context cost (kvtier's field)
        result["kvtier_offload"] = gen.offload.to_dict()
    return result


def _as_ids(ids) -> list[int]:
    if hasattr(ids, "keys") and "input_ids" in ids:
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _generation(state: ServerState, prefix: str, req, prompt_ids: list[int], sampling: SamplingParams,
                started_at: float) -> Generation:
    return Generation(state.engine, state.tokenizer, state.metrics, request_id=f"{prefix}-{uuid.uuid4().hex}",
                      prompt_token_ids=prompt_ids, sampling=sampling, namespace=req.cache_salt or "",
                      stops=req.stop_strings(), started_at=started_at,
                      on_finish=(lambda g: _record(state, g)) if state.trace is not None else None)


def _record(state: ServerState, gen: Generation) -> None:
    from kvtier.sim.trace import trace_hash_ids

    state.trace.record(round((gen.started_at - state.started_perf) * 1000, 3),
                       len(gen.prompt_token_ids), gen.num_generated_tokens,
                       trace_hash_ids(gen.prompt_token_ids, gen.namespace))


async def _collect(state: ServerState, request: Request, gen: Generation) -> str | Response:
    try:
        return await _unless_disconnected(request, gen.collect())
    except RequestFailedError as exc:
        return _error(state, 500, str(exc))
    except (EngineAbortedError, EngineDeadError) as exc:
        return _error(state, 503, str(exc))
    except HostRoomError as exc:  # another long request took the host room since the check
        return _error(state, 429 if exc.ever else 400, str(exc))
    except ValueError as exc:  # refused by the engine after all
        return _error(state, 400, str(exc))


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelled (raising ClientGone) as soon as the client disconnects. The body has
    been read, so the next ASGI message is `http.disconnect` (uvicorn sends it when the socket closes)."""
    result, error, gone = None, None, False
    async with anyio.create_task_group() as tasks:
        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        try:
            result = await work
        except Exception as exc:  # noqa: BLE001 — re-raised below, not wrapped in an ExceptionGroup
            error = exc
        tasks.cancel_scope.cancel()
    if gone:
        raise ClientGone()
    if error is not None:
        raise error
    return result


def _sse(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _stream(state: ServerState, gen: Generation, req, chunk, object_: str):
    """SSE lines: `chunk(text, finish_reason)` per delta, the final chunk, usage if asked, [DONE]."""
    try:
        async for delta in gen.deltas():
            yield _event(chunk(delta, None))
        yield _event(chunk(None, gen.finish_reason))
        if req.include_usage():
            yield _event(protocol.usage_chunk(gen.request_id, state.model_name, object_, gen.usage()))
    except (EngineAbortedError, EngineDeadError, RequestFailedError, ValueError) as exc:
        state.metrics.observe_error(500 if isinstance(exc, RequestFailedError) else 503)
        yield _event(protocol.error_body(str(exc), type="server_error"))
    yield "data: [DONE]\n\n"


def _completion_events(state: ServerState, gen: Generation, req):
    def chunk(text, finish_reason):
        return protocol.completion_chunk(gen.request_id, state.model_name, text or "", finish_reason)
    return _stream(state, gen, req, chunk, "text_completion")


def _chat_events(state: ServerState, gen: Generation, req):
    first = True

    def chunk(text, finish_reason):
        nonlocal first
        delta = {} if text is None else {"content": text}
        if first:
            delta, first = {"role": "assistant", **({"content": ""} if text is None else delta)}, False
        return protocol.chat_chunk(gen.request_id, state.model_name, delta, finish_reason)
    return _stream(state, gen, req, chunk, "chat.completion.chunk")
