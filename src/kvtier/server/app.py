"""The FastAPI app: OpenAI's /v1/completions and /v1/chat/completions (JSON or SSE), /v1/models,
/health, /metrics (Prometheus) and a small live dashboard, in front of one `AsyncEngine`.

Every bad request is answered with a 4xx and an OpenAI-style error body before it reaches the
engine (any body the JSON parser rejects, too deep or with a huge integer included; a body cut
short by the client is dropped quietly); a request that fails or whose client goes away — streaming
or not — is aborted in the engine alone. `max_tokens` beyond what fits is rejected
(`context_length_exceeded`), never clamped. A `model` the server does not serve is a 404 that names
the ones it does; a field kvtier does not implement is a 400 that names it (`protocol.REFUSED`).

A request becomes one engine request per choice: `n` (or `best_of`, of which the n with the highest
cumulative logprob are returned) per prompt, prompts being one or a batch (/v1/completions); engine
request "<response id>-<prompt>-<choice>". Seeded choices get seed, seed + 1, ... (vLLM's). Streams of
several choices are merged as they come.
"""

from __future__ import annotations

import asyncio
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
from kvtier.engine.engine import HostRoomError, OffloadUnavailableError
from kvtier.server import protocol
from kvtier.server.generation import Delta, EngineAbortedError, Generation
from kvtier.server.metrics import CONTENT_TYPE, EngineView, ServerMetrics

_DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
API_PREFIX = "/v1/"  # the OpenAI API: its requests' errors are what kvtier_request_errors_total counts
# what a browser asks for beside the dashboard: a KV block, in the dashboard's blue
FAVICON_SVG = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect x="1" y="3" width="14" height="4" '
               'fill="#3b82f6"/><rect x="1" y="9" width="9" height="4" fill="#3b82f6"/></svg>')


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
    model_names: list[str]              # the served names (aliases) a request's `model` may be
    metrics: ServerMetrics
    vocab_size: int
    created: int
    trace: object | None = None         # a sim.trace.TraceRecorder: finished requests, Mooncake format
    started_perf: float = 0.0          # time.perf_counter() at start: trace timestamps count from it
    sampling_defaults: protocol.SamplingDefaults = protocol.SamplingDefaults()  # for omitted sampling fields


def engine_view(async_engine: AsyncEngine) -> EngineView:
    stats = async_engine.engine.stats()
    return EngineView(**{f.name: getattr(stats, f.name) for f in fields(EngineView)})


def create_app(async_engine: AsyncEngine, tokenizer, model_name: str | list[str], *, manager=None,
               on_shutdown=None, record_trace=None,
               sampling_defaults: protocol.SamplingDefaults = protocol.SamplingDefaults(),
               kv_event_counts=None) -> FastAPI:
    """`model_name`: the name clients send, or several aliases. `on_shutdown()` runs after the engine
    thread stopped (flush blocks, close the tiers). `sampling_defaults`: what a request's omitted sampling
    fields are (`kvtier serve`: the model's generation_config; OpenAI's by default).
    `record_trace`: a JSONL path; every finished request is appended in the Mooncake trace format
    (`kvtier simulate` replays it). `kv_event_counts()`: (KV event batches published, device events dropped)
    for /metrics, with `--kv-events-config`."""
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
    model_names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not model_names:
        raise ValueError("at least one served model name")
    state = ServerState(async_engine, tokenizer, model_names,
                        ServerMetrics(lambda: engine_view(async_engine), manager, kv_event_counts), vocab_size,
                        int(time.time()),
                        started_perf=time.perf_counter(), sampling_defaults=sampling_defaults)
    if record_trace is not None:
        from kvtier.sim.trace import TraceRecorder

        state.trace = TraceRecorder(record_trace)
    app.state.kvtier = state
    _add_error_handlers(app, state)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _error(state: ServerState, status: int, message: str, *, type_: str | None = None, param=None, code=None,
           count: bool = True):
    """The OpenAI error body; `count`: an API request's error (the request-error metric counts only those)."""
    if count:
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
        # a path outside the API (a browser's /apple-touch-icon.png, a scanner) is not a failed request
        return _error(state, exc.status_code, str(exc.detail),
                      type_="not_found_error" if exc.status_code == 404 else None,
                      count=request.url.path.startswith(API_PREFIX))


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return protocol.model_list(state.model_names, state.created, state.sampling_defaults)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():
        return Response(FAVICON_SVG, media_type="image/svg+xml")

    @app.get("/dashboard", response_class=HTMLResponse)
    async def dashboard():
        return resources.files("kvtier.server").joinpath("static/dashboard.html").read_text()

    @app.get("/dashboard/data")
    async def dashboard_data():
        return {"model": state.model_names[0], **state.metrics.snapshot()}


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
        req = model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param(err["loc"])
        raise BadRequest(f"{param}: {err['msg']}" if param else err["msg"], param=param) from None
    try:
        protocol.check_fields(req)
    except protocol.FieldError as exc:
        raise BadRequest(str(exc), param=exc.param) from None
    return req


def _check_model(state: ServerState, req) -> None:
    if req.model not in state.model_names:
        raise BadRequest(f"the model {req.model!r} does not exist; this server serves "
                         + ", ".join(repr(name) for name in state.model_names),
                         param="model", code="model_not_found", status=404)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after"}


def _param(loc: tuple) -> str | None:
    """`messages.0.role` from pydantic's loc, without its union-member tags (`constrained-str`, `list[...]`)."""
    parts = [str(p) for i, p in enumerate(loc)
             if i == 0 or isinstance(p, int) or (str(p).isidentifier() and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


def _sampling(state: ServerState, req, num_prompt_tokens: int, max_tokens: int | None, *,
              default_max_tokens: int | None = None, **per_choice) -> SamplingParams:
    """`max_tokens` None: `default_max_tokens`, or as much as the context and the device budget allow
    (only a default is fitted to the room left; an explicit max_tokens that does not fit is rejected).
    `per_choice`: seed, logprobs, prompt_logprobs."""
    engine = state.engine.engine
    prompt_param = "messages" if hasattr(req, "messages") else "prompt"
    if max_tokens is None:
        room = max(1, engine.request_token_limit(req.kv_offload) - num_prompt_tokens)
        max_tokens = min(default_max_tokens or room, room)
    try:
        engine.check_request(num_prompt_tokens, max_tokens, req.kv_offload)
    except HostRoomError as exc:  # an offloaded request's host blocks: never (400) or not now (429)
        raise BadRequest(str(exc), param=_max_tokens_param(req), code="host_memory_exhausted",
                         status=429 if exc.ever else 400) from None
    except OffloadUnavailableError as exc:
        raise BadRequest(str(exc), param="kv_offload") from None
    except ContextLengthError as exc:
        param = prompt_param if exc.param == "prompt" else _max_tokens_param(req)
        raise BadRequest(str(exc), param=param, code="context_length_exceeded") from None
    except ValueError as exc:
        raise BadRequest(str(exc), param=prompt_param) from None
    if req.min_tokens > max_tokens:
        raise BadRequest(f"min_tokens ({req.min_tokens}) is more than max_tokens ({max_tokens})", param="min_tokens")
    try:
        return SamplingParams(max_tokens=max_tokens, **req.sampling_kwargs(state.sampling_defaults), **per_choice)
    except ValueError as exc:  # the protocol's bounds are the engine's: a mismatch is still the client's
        raise BadRequest(str(exc)) from None


def _max_tokens_param(req) -> str:
    return "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"


def _check_token_ids(state: ServerState, req) -> None:
    """Token ids a request names must be in the vocabulary (400 naming the field)."""
    named = {"stop_token_ids": req.stop_token_ids or [], "logit_bias": list(req.logit_bias_ids()),
             "allowed_token_ids": req.allowed_token_ids or []}
    for param, token_ids in named.items():
        outside = [t for t in token_ids if not 0 <= t < state.vocab_size]
        if outside:
            raise BadRequest(f"{param}: token id {outside[0]} is outside the vocabulary ({state.vocab_size})",
                             param=param)


def _truncated(req, prompt_ids: list[int]) -> list[int]:
    k = req.truncate_prompt_tokens
    return prompt_ids[-k:] if k is not None and k < len(prompt_ids) else prompt_ids


@dataclass(slots=True)
class _Prompt:
    token_ids: list[int]
    text: str                     # what `echo` returns


def _completion_prompts(state: ServerState, req: protocol.CompletionRequest) -> list[_Prompt]:
    prompts = []
    for prompt in req.prompts():
        if isinstance(prompt, str):
            ids = _truncated(req, [int(t) for t in state.tokenizer.encode(prompt, add_special_tokens=req.add_special_tokens)])
        else:
            ids = _truncated(req, list(prompt))
            if max(ids) >= state.vocab_size:
                raise BadRequest(f"token id {max(ids)} is outside the vocabulary ({state.vocab_size})", param="prompt")
        whole = isinstance(prompt, str) and req.truncate_prompt_tokens is None
        prompts.append(_Prompt(ids, prompt if whole else state.tokenizer.decode(ids, skip_special_tokens=False)))
    return prompts


_TEMPLATE_ARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                  "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                  "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}


def _chat_prompt(state: ServerState, req: protocol.ChatCompletionRequest) -> _Prompt:
    kwargs = req.chat_template_kwargs or {}
    clash = sorted(set(kwargs) & _TEMPLATE_ARGS)
    if clash:
        raise BadRequest(f"chat_template_kwargs: {clash[0]!r} is set by the server (or refused)",
                         param="chat_template_kwargs")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = state.tokenizer.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message, tokenize=False, **kwargs)
        ids = [int(t) for t in state.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)]
    except Exception as exc:  # noqa: BLE001 — a template that rejects these messages
        raise BadRequest(f"the chat template rejected the messages: {exc}", param="messages") from None
    return _Prompt(_truncated(req, ids), text)


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        started_at = time.perf_counter()
        req = await _parse(request, protocol.CompletionRequest)
        _check_model(state, req)
        _check_token_ids(state, req)
        prompts = _completion_prompts(state, req)
        request_id = _request_id("cmpl", req)
        echo_logprobs = req.logprobs if req.echo else None
        gens = []
        for i, prompt in enumerate(prompts):
            for j in range(req.num_choices()):
                # the first choice of a prompt computes its prompt logprobs, the others take its cached prefix
                # (streamed: each its own, each choice's first chunk carries them)
                wanted = [k for k in (echo_logprobs, req.prompt_logprobs) if k is not None]
                logprobs = req.logprobs if req.logprobs is not None else (0 if req.num_choices() > req.n else None)
                sampling = _sampling(state, req, len(prompt.token_ids), req.max_tokens,
                                     default_max_tokens=_DEFAULT_COMPLETION_TOKENS, seed=_seed(req, j),
                                     logprobs=logprobs,
                                     prompt_logprobs=max(wanted) if wanted and (j == 0 or req.stream) else None)
                gens.append(_generation(state, f"{request_id}-{i}-{j}", req, prompt.token_ids, sampling, started_at))
        if req.stream:
            return _sse(_completion_events(state, request_id, gens, req, prompts))
        failed = await _collect(state, request, gens)
        if failed is not None:
            return failed
        choices = []
        for i, prompt in enumerate(prompts):
            group = gens[i * req.num_choices():(i + 1) * req.num_choices()]
            for j, gen in enumerate(_best(group, req.n)):
                choices.append(_with_offload(_completion_choice(state, req, i * req.n + j, gen, prompt,
                                                                group[0].prompt_logprobs), gen))
        return protocol.completion(request_id, req.model, choices, protocol.add_usage([g.usage() for g in gens]))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        started_at = time.perf_counter()
        req = await _parse(request, protocol.ChatCompletionRequest)
        _check_model(state, req)
        _check_token_ids(state, req)
        prompt = _chat_prompt(state, req)
        request_id = _request_id("chatcmpl", req)
        gens = [_generation(state, f"{request_id}-0-{j}", req, prompt.token_ids,
                            _sampling(state, req, len(prompt.token_ids), req.token_limit(), seed=_seed(req, j),
                                      logprobs=req.num_logprobs(),
                                      prompt_logprobs=req.prompt_logprobs if j == 0 else None), started_at)
                for j in range(req.n)]
        if req.stream:
            return _sse(_chat_events(state, request_id, gens, req))
        failed = await _collect(state, request, gens)
        if failed is not None:
            return failed
        choices = [_with_offload(protocol.chat_choice(j, gen.text.text, gen.finish_reason,
                                                      protocol.chat_logprobs(gen.logprobs, _token_text(state, req))
                                                      if req.logprobs else None, **_token_ids_extra(req, gen)), gen)
                   for j, gen in enumerate(gens)]
        extra = {}
        if req.prompt_logprobs is not None:
            extra["prompt_logprobs"] = protocol.vllm_prompt_logprobs(
                _top(gens[0].prompt_logprobs, req.prompt_logprobs), _token_text(state, req))
        if req.return_token_ids:
            extra["prompt_token_ids"] = prompt.token_ids
        return protocol.chat_completion(request_id, req.model, choices,
                                        protocol.add_usage([g.usage() for g in gens]), **extra)


def _with_offload(choice: dict, gen: Generation) -> dict:
    """A choice longer than the device (kv_offload) says what its context cost: `kvtier_offload`."""
    if gen.offload is not None:
        choice["kvtier_offload"] = gen.offload.to_dict()
    return choice


def _request_id(prefix: str, req) -> str:
    return f"{prefix}-{req.request_id}" if req.request_id else f"{prefix}-{uuid.uuid4().hex}"


def _seed(req, choice: int) -> int | None:
    """Choice j of a seeded request draws with seed + j (vLLM's parallel sampling), wrapped into range."""
    if req.seed is None:
        return None
    from kvtier.engine.sequence import MAX_SEED, MIN_SEED

    seed = req.seed + choice
    return seed if seed <= MAX_SEED else MIN_SEED + (seed - MAX_SEED - 1)


def _best(group: list[Generation], n: int) -> list[Generation]:
    """best_of: the n choices with the highest cumulative logprob (in their original order)."""
    if len(group) == n:
        return group
    keep = sorted(range(len(group)), key=lambda k: group[k].cumulative_logprob, reverse=True)[:n]
    return [group[k] for k in sorted(keep)]


def _token_text(state: ServerState, req):
    if req.return_tokens_as_token_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: state.tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entries, k: int | None):
    """The entries with at most `k` top tokens each (a request's prompt logprobs are computed once, at
    the largest k it asked for)."""
    from kvtier.engine.sequence import TokenLogprob

    return [None if e is None else TokenLogprob(e.token_id, e.logprob, e.rank, e.top[:k]) for e in entries]


def _token_ids_extra(req, gen: Generation) -> dict:
    return {"token_ids": list(gen.token_ids)} if req.return_token_ids else {}


def _completion_choice(state: ServerState, req, index: int, gen: Generation, prompt: _Prompt,
                       prompt_logprobs) -> dict:
    text = (prompt.text if req.echo else "") + gen.text.text
    logprobs = None
    if req.logprobs is not None:
        entries = (_top(prompt_logprobs, req.logprobs) if req.echo else []) + gen.logprobs
        token_ids = (prompt.token_ids if req.echo else []) + gen.token_ids
        logprobs = protocol.completion_logprobs(token_ids, entries, _token_text(state, req))
    extra = _token_ids_extra(req, gen)
    if req.return_token_ids:
        extra["prompt_token_ids"] = prompt.token_ids
    if req.prompt_logprobs is not None:
        extra["prompt_logprobs"] = protocol.vllm_prompt_logprobs(_top(prompt_logprobs, req.prompt_logprobs),
                                                                 _token_text(state, req))
    return protocol.completion_choice(index, text, gen.finish_reason, logprobs, **extra)


def _generation(state: ServerState, request_id: str, req, prompt_ids: list[int], sampling: SamplingParams,
                started_at: float) -> Generation:
    return Generation(state.engine, state.tokenizer, state.metrics, request_id=request_id,
                      prompt_token_ids=prompt_ids, sampling=sampling, namespace=req.cache_salt or "",
                      stops=req.stop_strings(), started_at=started_at,
                      on_finish=(lambda g: _record(state, g)) if state.trace is not None else None,
                      include_stop=req.include_stop_str_in_output, skip_special_tokens=req.skip_special_tokens)


def _record(state: ServerState, gen: Generation) -> None:
    from kvtier.sim.trace import trace_hash_ids

    state.trace.record(round((gen.started_at - state.started_perf) * 1000, 3),
                       len(gen.prompt_token_ids), gen.num_generated_tokens,
                       trace_hash_ids(gen.prompt_token_ids, gen.namespace))


async def _collect(state: ServerState, request: Request, gens: list[Generation]) -> Response | None:
    """Run every choice to its end (their text and logprobs stay in each Generation); an error
    response if one failed (the others are aborted)."""
    try:
        await _unless_disconnected(request, _gather([gen.collect() for gen in gens]))
        return None
    except RequestFailedError as exc:
        return _error(state, 500, str(exc))
    except (EngineAbortedError, EngineDeadError) as exc:
        return _error(state, 503, str(exc))
    except HostRoomError as exc:  # another long request took the host room since the check
        return _error(state, 429 if exc.ever else 400, str(exc))
    except ValueError as exc:  # refused by the engine after all
        return _error(state, 400, str(exc))


async def _gather(coros: list) -> list:
    """All results, or the first exception once the others are cancelled (and have cleaned up)."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]
    finally:
        with anyio.CancelScope(shield=True):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


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


async def _merged(gens: list[Generation]):
    """(choice index, Delta) as each choice's deltas come, then (index, None) when that choice ends.
    An error in one raises here (the others are cancelled: their engine requests aborted)."""
    if len(gens) == 1:
        async for delta in gens[0].deltas():
            yield 0, delta
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, gen: Generation) -> None:
        try:
            async for delta in gen.deltas():
                queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except Exception as exc:  # noqa: BLE001 — handed to the consumer
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        for _ in range(len(gens)):
            while True:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield index, item
                if item is None:
                    break
    finally:
        with anyio.CancelScope(shield=True):
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _stream(state: ServerState, request_id: str, model: str, gens: list[Generation], req, chunk,
                  object_: str):
    """SSE lines: `chunk(index, delta, finish_reason)` per delta (None: skipped), a final chunk per
    choice, usage if asked, [DONE]."""
    try:
        async for index, delta in _merged(gens):
            event = chunk(index, delta, None if delta is not None else gens[index].finish_reason)
            if event is not None:
                yield _event(event)
        if req.include_usage():
            yield _event(protocol.usage_chunk(request_id, model, object_,
                                              protocol.add_usage([g.usage() for g in gens])))
    except (EngineAbortedError, EngineDeadError, RequestFailedError, ValueError) as exc:
        state.metrics.observe_error(500 if isinstance(exc, RequestFailedError) else 503)
        yield _event(protocol.error_body(str(exc), type="server_error"))
    yield "data: [DONE]\n\n"


def _completion_events(state: ServerState, request_id: str, gens: list[Generation], req, prompts: list[_Prompt]):
    token_text = _token_text(state, req)
    offsets = [0] * len(gens)  # text_offset continues across a choice's chunks

    def chunk(index: int, delta: Delta | None, finish_reason):
        if delta is None:
            return protocol.completion_chunk(request_id, req.model, protocol.completion_choice(index, "", finish_reason))
        prompt = prompts[index // req.n]
        echo = req.echo and delta.first
        text = (prompt.text if echo else "") + delta.text
        logprobs = None
        if req.logprobs is not None:
            entries = (_top(gens[index].prompt_logprobs, req.logprobs) if echo else []) + delta.logprobs
            token_ids = (prompt.token_ids if echo else []) + delta.token_ids
            logprobs = protocol.completion_logprobs(token_ids, entries, token_text, offsets[index])
            offsets[index] += sum(len(token) for token in logprobs["tokens"])
        if not text and not (logprobs and logprobs["tokens"]):
            return None
        extra = {"token_ids": delta.token_ids} if req.return_token_ids else {}
        if req.return_token_ids and delta.first:
            extra["prompt_token_ids"] = prompt.token_ids
        return protocol.completion_chunk(request_id, req.model,
                                         protocol.completion_choice(index, text, None, logprobs, **extra))
    return _stream(state, request_id, req.model, gens, req, chunk, "text_completion")


def _chat_events(state: ServerState, request_id: str, gens: list[Generation], req):
    token_text = _token_text(state, req)
    started = [False] * len(gens)

    def chunk(index: int, delta: Delta | None, finish_reason):
        text = delta.text if delta is not None else None
        logprobs = protocol.chat_logprobs(delta.logprobs, token_text) if req.logprobs and delta is not None else None
        if delta is not None and not text and not (logprobs and logprobs["content"]) and started[index]:
            return None
        body = {} if not text else {"content": text}
        if not started[index]:
            body, started[index] = {"role": "assistant", "content": text or ""}, True
        if delta is not None and req.return_token_ids:
            body["token_ids"] = delta.token_ids
        return protocol.chat_chunk(request_id, req.model, index, body, finish_reason, logprobs)
    return _stream(state, request_id, req.model, gens, req, chunk, "chat.completion.chunk")
