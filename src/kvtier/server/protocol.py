"""The OpenAI wire format: request models (validated strictly) and the response/chunk builders.

Requests are strict pydantic models: `"max_tokens": "5"` is a type error (OpenAI rejects it too),
unknown extra fields are ignored (clients send vendor fields). Responses are plain dicts in
OpenAI's shape; `openai`'s client parses them.

Sampling fields are held to what the sampler handles: temperature in [0, 2] (below
`sampler.MIN_TEMPERATURE`, 1e-5, it is greedy), top_p in (0, 1] (a tiny top_p keeps the top token),
seed within what `torch.Generator.manual_seed` accepts; every string must be encodable as UTF-8
(JSON's `"\ud800"` escapes give lone surrogates, which tokenizers and block keys cannot hash).
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from kvtier.engine.sequence import MAX_SEED, MIN_SEED

_STRICT = ConfigDict(strict=True, extra="ignore")


def _utf8(text: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"must be valid UTF-8 (a lone surrogate at position {exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = _STRICT
    model: Text
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    seed: Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)] | None = None
    stop: Text | list[Text] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Text | None = None  # vLLM's field: the engine namespace that isolates a tenant's prefix cache
    kv_offload: Text | None = None  # kvtier's: off | exact | sparse:BUDGET for a request longer than the device

    @field_validator("kv_offload")
    @classmethod
    def _offload_mode(cls, mode: str | None) -> str | None:
        from kvtier.engine.offload import parse_offload

        parse_offload(mode)  # ValueError naming the accepted forms -> 400 naming kv_offload
        return mode

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        return stop

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    # A text prompt or its token ids (batches of prompts are not supported: n=1, one prompt).
    prompt: Annotated[Text, Field(min_length=1)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None  # the newer name of max_tokens

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses ------------------------------------------------------------------------------------

def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def completion(request_id: str, model: str, text: str, finish_reason: str | None, usage_: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage_}


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}]}


def chat_completion(request_id: str, model: str, text: str, finish_reason: str | None, usage_: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish_reason, "logprobs": None}],
            "usage": usage_}


def chat_chunk(request_id: str, model: str, delta: dict, finish_reason: str | None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}


def usage_chunk(request_id: str, model: str, object_: str, usage_: dict) -> dict:
    """The last chunk when `stream_options.include_usage` is set: no choices, only usage."""
    return {"id": request_id, "object": object_, "created": int(time.time()), "model": model,
            "choices": [], "usage": usage_}


def model_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "kvtier"}]}
