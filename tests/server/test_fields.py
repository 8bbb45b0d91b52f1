"""No request field is silently ignored: every field of OpenAI's and vLLM's request schemas, on both
endpoints, is either honoured (a field of kvtier's request model, parsed and type-checked) or refused
with a 400 that names it (`protocol.REFUSED`, which still accepts the values that ask for nothing).

OpenAI's fields come from the `openai` package's TypedDicts; vLLM's from data/vllm_request_fields.json
(derived once from vLLM 0.32's pydantic models, see its "source")."""

import json
import typing
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from kvtier.server import protocol

VLLM = json.loads((Path(__file__).parent / "data" / "vllm_request_fields.json").read_text())
# `stream` lives in the Streaming/NonStreaming subclasses of the Base TypedDicts
OPENAI = {"completions": set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase)) | {"stream"},
          "chat_completions": set(typing.get_type_hints(chat_create_params.CompletionCreateParamsBase)) | {"stream"}}
MODELS = {"completions": protocol.CompletionRequest, "chat_completions": protocol.ChatCompletionRequest}
PATHS = {"completions": "/v1/completions", "chat_completions": "/v1/chat/completions"}
BASE = {"completions": {"model": "tiny", "prompt": "Speak", "max_tokens": 1},
        "chat_completions": {"model": "tiny", "messages": [{"role": "user", "content": "Speak"}], "max_tokens": 1}}
NONSENSE = [[["kvtier-test"]]]  # no field of either schema takes this: its type is wrong for every honoured one


def schema_fields(endpoint: str) -> list[str]:
    return sorted(OPENAI[endpoint] | set(VLLM[endpoint]))


def test_both_schemas_are_there():
    assert VLLM["vllm_version"] == "0.32.0"
    assert {"logprobs", "echo", "best_of", "suffix", "logit_bias"} <= OPENAI["completions"]
    assert {"top_k", "min_p", "prompt_logprobs", "ignore_eos", "min_tokens"} <= set(VLLM["completions"])
    assert {"tools", "response_format", "top_logprobs"} <= OPENAI["chat_completions"]


@pytest.mark.parametrize("endpoint", ["completions", "chat_completions"])
def test_every_schema_field_is_honoured_or_refused_never_both(endpoint):
    honoured, refused = set(MODELS[endpoint].model_fields), set(MODELS[endpoint].refused_fields())
    assert not honoured & refused
    assert [f for f in schema_fields(endpoint) if f not in honoured | refused] == []


@pytest.mark.parametrize("endpoint", ["completions", "chat_completions"])
def test_each_field_is_parsed_or_refused_by_name(tiny_server, endpoint):
    """A value no field takes is a 400 naming that field, for every field of both schemas (an
    ignored field would give 200); each refused field's no-op values are accepted."""
    url, _ = tiny_server
    named = {}
    for field in schema_fields(endpoint):
        body = {**BASE[endpoint], field: NONSENSE}
        response = httpx.post(url + PATHS[endpoint], json=body, timeout=60)
        error = response.json().get("error") or {}
        named[field] = (response.status_code, (error.get("param") or "").split(".")[0])
        if field in MODELS[endpoint].refused_fields():
            for accepted in MODELS[endpoint].refused_fields()[field][0]:
                ok = httpx.post(url + PATHS[endpoint], json={**BASE[endpoint], field: accepted}, timeout=60)
                assert ok.status_code == 200, (field, accepted, ok.text)
    assert {f: v for f, v in named.items() if v != (400, f)} == {}


def test_refusals_name_the_field_and_say_why(tiny_server):
    url, _ = tiny_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    cases = [("completions", {"suffix": "end"}, "suffix", "infill"),
             ("chat_completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
             ("chat_completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
              "response_format", "structured output"),
             ("completions", {"use_beam_search": True}, "use_beam_search", "beam search"),
             ("completions", {"frobnicate": 1}, "frobnicate", "unknown field")]
    for endpoint, extra, param, why in cases:
        response = httpx.post(url + PATHS[endpoint], json={**BASE[endpoint], **extra}, timeout=60)
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error")
        assert why in error["message"]
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model="tiny", prompt="Speak", suffix="end", max_tokens=1)


def test_an_unknown_model_is_404_naming_the_served_ones(tiny_server):
    url, _ = tiny_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    for call in (lambda: client.completions.create(model="gpt-4", prompt="Speak", max_tokens=1),
                 lambda: client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
        assert "'gpt-4' does not exist; this server serves 'tiny'" in info.value.body["message"]


@pytest.mark.parametrize("extra, param", [
    ({"top_logprobs": 2}, "top_logprobs"),                                     # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"stop_token_ids": [256]}, "stop_token_ids"), ({"logit_bias": {"300": 1}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"allowed_token_ids": [999]}, "allowed_token_ids"), ({"min_tokens": 5}, "min_tokens"),
    ({"n": 0}, "n"), ({"n": 65}, "n"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
])
def test_bad_values_of_honoured_fields_name_them(tiny_server, extra, param):
    url, _ = tiny_server
    response = httpx.post(url + PATHS["chat_completions"], json={**BASE["chat_completions"], **extra}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize("extra, param", [
    ({"best_of": 1, "n": 2}, "best_of"), ({"best_of": 3, "stream": True}, "best_of"),
    ({"logprobs": 21}, "logprobs"), ({"prompt": ["a"] * 9, "n": 8}, "n"),
])
def test_bad_completion_choices_name_the_field(tiny_server, extra, param):
    url, _ = tiny_server
    response = httpx.post(url + PATHS["completions"], json={**BASE["completions"], **extra}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
