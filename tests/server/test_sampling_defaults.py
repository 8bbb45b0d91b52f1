"""What a request's omitted sampling fields default to: the model's generation_config (vLLM's
`--generation-config auto`, read as transformers' `generate()` reads it) or OpenAI's; sent fields win."""

import pytest
from transformers import GenerationConfig

from kvtier.errors import ConfigError
from kvtier.server.protocol import ChatCompletionRequest, SamplingDefaults

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_config_without_do_sample_is_greedy():
    # what transformers loads for SmolLM2-135M-Instruct: token ids only (bos 1, eos 2, pad 2)
    defaults = SamplingDefaults.from_generation_config(GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2))
    assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.0, 1.0, 0)
    assert SamplingDefaults.from_generation_config(None).temperature == 0.0


def test_a_sampling_config_brings_its_fields_and_generates_defaults():
    defaults = SamplingDefaults.from_generation_config(GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9))
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p, defaults.repetition_penalty) == \
        (0.6, 0.9, 50, 0.0, 1.0)  # top_k 50: generate()'s default when sampling


def test_sent_fields_win_omitted_ones_default():
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1)
    omitted = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES}).sampling_kwargs(defaults)
    assert {k: omitted[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")} == \
        {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1}
    sent = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": MESSAGES, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
         "repetition_penalty": 1.0}).sampling_kwargs(defaults)
    assert {k: sent[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")} == \
        {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    openai = ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES}).sampling_kwargs()
    assert (openai["temperature"], openai["top_p"]) == (1.0, 1.0)


def test_a_config_outside_the_request_bounds_is_refused_at_start():
    with pytest.raises(ConfigError, match="sets temperature 3.0, outside what a request may send: "
                                          "generation_config vllm"):
        SamplingDefaults.from_generation_config(GenerationConfig(do_sample=True, temperature=3.0))
