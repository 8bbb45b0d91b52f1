"""The OpenAI wire format: request models (validated strictly) and the response/chunk builders.

Requests are strict pydantic models: `"max_tokens": "5"` is a type error (OpenAI rejects it too).
No field is silently ignored: every field of OpenAI's and vLLM's request schemas is either honoured
(a field of these models) or listed in `REFUSED` with the values that ask for nothing (null, false,
the default); any other value is a 400 that names the field, and so is a field neither schema knows
(`check_fields`). Responses are plain dicts in OpenAI's shape (logprobs objects included); `openai`'s
client parses them.

Sampling fields are held to what the sampler handles: temperature in [0, 2] (below
`sampler.MIN_TEMPERATURE`, 1e-5, it is greedy), top_p in (0, 1] (a tiny top_p keeps the top token),
seed within what `torch.Generator.manual_seed` accepts; every string must be encodable as UTF-8
(JSON's `"\ud800"` escapes give lone surrogates, which tokenizers and block keys cannot hash).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from kvtier.engine.sequence import MAX_LOGPROBS, MAX_SEED, MIN_SEED, TokenLogprob
from kvtier.errors import ConfigError

_STRICT = ConfigDict(strict=True, extra="ignore")
_REQUEST = ConfigDict(strict=True, extra="allow")  # extra fields are checked by `check_fields`
MAX_CHOICES = 64  # n (or best_of) x prompts, per request

# field -> (the values that ask for nothing, why any other is refused). Fields of OpenAI's or vLLM's
# request schemas that kvtier does not implement; tests/server/test_fields.py enumerates both schemas.
_NO_BEAM = "beam search is not implemented"
REFUSED: dict[str, tuple[tuple, str]] = {
    # both endpoints
    "user": ((None,), "kvtier keeps no per-user records"),
    "use_beam_search": ((None, False), _NO_BEAM),
    "length_penalty": ((None, 1, 1.0), _NO_BEAM + " (length_penalty applies to it)"),
    "watermarking": ((None,), "watermarking is not implemented"),
    "spaces_between_special_tokens": ((None, True), "the tokenizer's own decoding is used"),
    "truncation_side": ((None, "left"), "a prompt is truncated on the left only"),
    "logprob_token_ids": ((None, []), "logprobs of chosen token ids are not implemented (use logprobs)"),
    "bad_words": ((None, []), "bad_words is not implemented (use logit_bias)"),
    "prompt_embeds": ((None,), "prompt embeddings are not accepted"),
    "response_format": ((None, {"type": "text"}), "structured output (JSON mode, schemas) is not implemented"),
    "structured_outputs": ((None,), "structured output is not implemented"),
    "priority": ((None, 0), "the scheduler is FIFO: no priorities"),
    "session_id": ((None,), "sessions are not implemented"),
    "routed_experts_prompt_start": ((None, 0), "this is not a mixture-of-experts server"),
    "return_token_offsets": ((None, False), "token offsets are not implemented"),
    "mm_payload": ((None, "tensors"), "no multimodal input"),
    "return_mm_kwargs": ((None, False), "no multimodal input"),
    "kv_transfer_params": ((None,), "use kvtier's tiers, not vLLM's KV transfer"),
    "ec_transfer_params": ((None,), "no encoder-cache transfer"),
    "vllm_xargs": ((None,), "no vLLM extension arguments"),
    "repetition_detection": ((None,), "repetition detection is not implemented"),
    "thinking_token_budget": ((None,), "no reasoning budget: this is not a reasoning server"),
    "stream_interval": ((None, 1), "every token is streamed as it comes"),
    # /v1/completions
    "suffix": ((None, ""), "this model has no fill-in-the-middle (infill) mode"),
    # /v1/chat/completions
    "tools": ((None, []), "tool calling is not implemented"),
    "tool_choice": ((None, "none", "auto"), "tool calling is not implemented"),
    "functions": ((None, []), "function calling is not implemented"),
    "function_call": ((None, "none", "auto"), "function calling is not implemented"),
    "parallel_tool_calls": ((None, True, False), "tool calling is not implemented"),
    "reasoning_effort": ((None,), "this is not a reasoning model"),
    "include_reasoning": ((None, True, False), "this is not a reasoning model"),
    "audio": ((None,), "audio output is not implemented"),
    "modalities": ((None, ["text"]), "text is the only modality"),
    "metadata": ((None,), "completions are not stored"),
    "store": ((None, False), "completions are not stored"),
    "moderation": ((None,), "no moderation"),
    "prediction": ((None,), "predicted outputs are not implemented"),
    "prompt_cache_key": ((None,), "use cache_salt: kvtier's prefix cache is per namespace"),
    "prompt_cache_options": ((None,), "use cache_salt: kvtier's prefix cache is per namespace"),
    "prompt_cache_retention": ((None,), "retention is the tiers' (their LRU), not per request"),
    "safety_identifier": ((None,), "kvtier keeps no per-user records"),
    "service_tier": ((None, "auto", "default"), "one service tier"),
    "verbosity": ((None,), "verbosity is not implemented"),
    "web_search_options": ((None,), "no web search"),
    "documents": ((None, []), "documents (RAG templates) are not implemented"),
    "chat_template": ((None,), "the model's own chat template is used; custom templates are not accepted"),
    "media_io_kwargs": ((None,), "no multimodal input"),
    "mm_processor_kwargs": ((None,), "no multimodal input"),
    "return_prompt_text": ((None, False), "the prompt text is not returned (echo it with /v1/completions)"),
}
CHAT_REFUSED = {**REFUSED, "echo": ((None, False), "echo is for /v1/completions only")}  # a chat field of vLLM's


# transformers' `generate()` defaults for what a generation_config leaves unset (GenerationConfig's
# `_get_default_generation_params`): greedy unless do_sample; when sampling, top_k 50
_GENERATE_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": 0.0,
                      "repetition_penalty": 1.0}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request's omitted sampling fields default to (a field the client sends is always its own).
    OpenAI's defaults (temperature 1, top_p 1, no top_k, min_p or repetition penalty), or the model's
    `generation_config` as transformers' `generate()` reads it (`from_generation_config`); `source` says which."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0            # 0: all tokens
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "OpenAI's defaults"

    def __post_init__(self) -> None:
        bounds = {"temperature": 0 <= self.temperature <= 2, "top_p": 0 < self.top_p <= 1, "top_k": self.top_k >= 0,
                  "min_p": 0 <= self.min_p <= 1, "repetition_penalty": 0 < self.repetition_penalty <= 2}
        for name, ok in bounds.items():
            if not ok:
                raise ConfigError(f"generation_config: {self.source} sets {name} {getattr(self, name)}, outside what a "
                                  f"request may send: generation_config vllm (OpenAI's defaults) works")

    @classmethod
    def from_generation_config(cls, generation_config) -> SamplingDefaults:
        """vLLM's `--generation-config auto`, read as `model.generate()` reads it: a config that does not set
        `do_sample` (SmolLM2-Instruct's sets only token ids) decodes greedily; one that samples brings its
        temperature, top_p, top_k, min_p and repetition_penalty (transformers' defaults for those it leaves out)."""
        def value(name: str):
            got = getattr(generation_config, name, None) if generation_config is not None else None
            return _GENERATE_DEFAULTS[name] if got is None else got

        if not value("do_sample"):
            return cls(temperature=0.0, source="the model's generation_config (no do_sample: greedy, as generate())")
        return cls(temperature=float(value("temperature")), top_p=float(value("top_p")), top_k=int(value("top_k")),
                   min_p=float(value("min_p")), repetition_penalty=float(value("repetition_penalty")),
                   source="the model's generation_config (do_sample: its sampling fields, as generate())")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FieldError(ValueError):
    """A request field (`param`) that is refused, or inconsistent with another."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def check_fields(req: "_SamplingFields") -> None:
    """Raise `FieldError` for the first extra field that is unknown or asks for what kvtier does not do,
    then for fields that contradict each other."""
    refused = req.refused_fields()
    for name, value in (req.model_extra or {}).items():
        if name not in refused:
            raise FieldError(name, f"unknown field {name!r}: neither OpenAI's nor vLLM's request schema has it")
        accepted, why = refused[name]
        if not any(value is ok or (value == ok and type(value) is type(ok)) for ok in accepted):
            raise FieldError(name, f"{name} is not supported: {why}")
    req.check_consistent()


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


Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's)."""

    model_config = _REQUEST
    model: Text
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    # omitted (None): the server's SamplingDefaults (the model's generation_config, or OpenAI's 1 and 1)
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=MIN_SEED, le=MAX_SEED)] | None = None
    stop: Text | list[Text] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    # vLLM's
    cache_salt: Text | None = None  # the engine namespace that isolates a tenant's prefix cache
    top_k: Annotated[int, Field(ge=-1)] | None = None  # -1, 0: all tokens
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0, allow_inf_nan=False)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None  # keep the prompt's last k tokens
    prompt_logprobs: NumLogprobs | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:<id>"
    return_token_ids: bool | None = None            # the choice's token ids and the prompt's
    request_id: Annotated[Text, Field(min_length=1, max_length=256)] | None = None  # the response id's suffix
    # kvtier's
    kv_offload: Text | None = None  # off | exact | sparse:BUDGET for a request longer than the device

    @field_validator("kv_offload")
    @classmethod
    def _offload_mode(cls, mode: str | None) -> str | None:
        from kvtier.config import parse_offload

        parse_offload(mode)  # ValueError naming the accepted forms -> 400 naming kv_offload
        return mode

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

    def num_choices(self) -> int:
        return self.n

    @classmethod
    def refused_fields(cls) -> dict[str, tuple[tuple, str]]:
        return REFUSED

    def check_consistent(self) -> None:
        if self.stream and self.prompt_logprobs is not None:
            raise FieldError("prompt_logprobs", "prompt_logprobs is not available when streaming "
                                                "(use echo with logprobs on /v1/completions)")
        self.logit_bias_ids()

    def logit_bias_ids(self) -> dict[int, float]:
        try:
            return {int(token): bias for token, bias in (self.logit_bias or {}).items()}
        except ValueError:
            raise FieldError("logit_bias", "logit_bias keys must be token ids (integers as strings)") from None

    def sampling_kwargs(self, defaults: SamplingDefaults = SamplingDefaults()) -> dict[str, Any]:
        """`SamplingParams` fields from this request (not max_tokens, logprobs, seed: per choice); the fields it
        omits from `defaults`."""
        def pick(name: str):
            sent = getattr(self, name)
            return getattr(defaults, name) if sent is None else sent

        return dict(temperature=pick("temperature"), top_p=pick("top_p"), top_k=max(pick("top_k"), 0),
                    min_p=pick("min_p"), repetition_penalty=pick("repetition_penalty"),
                    presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                    logit_bias=self.logit_bias_ids(), stop_token_ids=list(self.stop_token_ids or []),
                    ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                    allowed_token_ids=self.allowed_token_ids, kv_offload=self.kv_offload)


Prompt = Annotated[Text, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    # a text prompt, its token ids, or a batch of either: choice i * n + j is prompt i's j-th
    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1)]
    echo: bool = False
    logprobs: NumLogprobs | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)

    def check_consistent(self) -> None:
        super().check_consistent()
        if self.best_of is not None and self.best_of < self.n:
            raise FieldError("best_of", f"best_of must be >= n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise FieldError("best_of", "best_of > n cannot stream (the best are known only at the end)")
        if self.num_choices() * len(self.prompts()) > MAX_CHOICES:
            raise FieldError("n", f"at most {MAX_CHOICES} choices (best_of or n, times the prompts) per request")

    def num_choices(self) -> int:
        """Sequences generated per prompt: best_of, of which the n with the highest cumulative logprob return."""
        return self.best_of or self.n


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
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    # vLLM's
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def check_consistent(self) -> None:
        super().check_consistent()
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise FieldError("continue_final_message", "continue_final_message needs add_generation_prompt false")

    @classmethod
    def refused_fields(cls) -> dict[str, tuple[tuple, str]]:
        return CHAT_REFUSED

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# -- responses ------------------------------------------------------------------------------------

def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def add_usage(usages: list[dict]) -> dict:
    return usage(sum(u["prompt_tokens"] for u in usages), sum(u["completion_tokens"] for u in usages),
                 sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages))


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprob | None], token_text,
                        first_offset: int = 0) -> dict:
    """The legacy completions object: tokens, their logprobs, the top ones (with the token itself, as
    vLLM does) and each token's character offset in the choice's text. A `None` entry (an echoed
    prompt's first token) has no logprob."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = first_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = token_text(token_id)
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None), top_logprobs.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top_logprobs.append({**{token_text(t): lp for t, lp in entry.top}, text: entry.logprob})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}


def chat_logprobs(entries: list[TokenLogprob], token_text) -> dict:
    """The chat object: `content`, one item per token with its `top_logprobs` (top_logprobs of them)."""
    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def vllm_prompt_logprobs(entries: list[TokenLogprob | None], token_text) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: {logprob, rank, decoded_token}} of the
    token itself and the top ones."""
    def item(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        top = {str(t): item(t, lp, rank) for rank, (t, lp) in enumerate(e.top, start=1)}
        out.append({**top, str(e.token_id): item(e.token_id, e.logprob, e.rank)})
    return out


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None,
                      **extra) -> dict:
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs, **extra}


def completion(request_id: str, model: str, choices: list[dict], usage_: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_}


def completion_chunk(request_id: str, model: str, choice: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice]}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None, **extra) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
            "logprobs": logprobs, **extra}


def chat_completion(request_id: str, model: str, choices: list[dict], usage_: dict, **extra) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage_, **extra}


def chat_chunk(request_id: str, model: str, index: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}


def usage_chunk(request_id: str, model: str, object_: str, usage_: dict) -> dict:
    """The last chunk when `stream_options.include_usage` is set: no choices, only usage."""
    return {"id": request_id, "object": object_, "created": int(time.time()), "model": model,
            "choices": [], "usage": usage_}


def model_list(models: list[str], created: int, sampling_defaults: SamplingDefaults) -> dict:
    """OpenAI's model list; each model also says what a request's omitted sampling fields default to."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "kvtier",
                                        "kvtier_sampling_defaults": sampling_defaults.to_dict()}
                                       for model in models]}
