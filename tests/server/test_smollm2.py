"""The server on the real SmolLM2 with its chat template, through the `openai` client."""

import sys
from pathlib import Path

import openai
import pytest
import torch

from kvtier.codecs import get_codec
from kvtier.engine import AsyncEngine, EngineConfig, LLMEngine
from kvtier.tiers.manager import build_manager
from kvtier.server.app import create_app

sys.path.insert(0, str(Path(__file__).parent))
from server_support import running  # noqa: E402

pytestmark = pytest.mark.smollm2


def test_chat_equals_generate_and_second_turn_hits_the_cache(smollm2):
    layout = smollm2.kv_layout(16)
    manager = build_manager(["dram:64MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    engine = AsyncEngine(LLMEngine(smollm2, EngineConfig(device_kv_budget_bytes=64 * layout.block_bytes,
                                                         block_tokens=16), manager))
    app = create_app(engine, smollm2.tokenizer, "smollm2", manager=manager, on_shutdown=manager.close)
    messages = [{"role": "system", "content": "You are a helpful assistant who knows Shakespeare well."},
                {"role": "user", "content": "In one sentence, who is Hamlet?"}]
    ids = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False)
    out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    expected = smollm2.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    with running(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20, temperature=0)
        stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20, temperature=0,
                                                stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        again = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=20, temperature=0)
    assert first.choices[0].message.content == expected == streamed
    assert first.usage.prompt_tokens == len(ids)
    assert again.usage.prompt_tokens_details.cached_tokens == (len(ids) - 1) // 16 * 16 > 0


README_REQUEST = {"model": "smollm2", "messages": [{"role": "user", "content": "What is a KV cache?"}],
                  "max_tokens": 48}


def test_readme_request_defaults_sampling_from_the_generation_config(smollm2):
    """`kvtier serve`'s app (build_app, generation_config auto): the README's request, which sends no temperature,
    decodes as SmolLM2's generation_config says (no do_sample: greedy), the same text as `generate()`; a field
    the client sends is its own."""
    import httpx

    from kvtier.server.cli import build_app
    from kvtier.server.config import ServeConfig

    ids = smollm2.tokenizer.apply_chat_template(README_REQUEST["messages"], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
    out = smollm2.model.generate(torch.tensor([ids]), max_new_tokens=48)  # the model's own generation_config
    expected = smollm2.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    config = ServeConfig.load(None, model="smollm2", tiers=["dram:64MiB"], device_kv_budget="64MiB")
    with running(build_app(config)) as url:
        models = httpx.get(url + "/v1/models").json()["data"]
        answer = httpx.post(url + "/v1/chat/completions", json=README_REQUEST, timeout=120).json()
        sampled = [httpx.post(url + "/v1/chat/completions", timeout=120,
                              json={**README_REQUEST, "temperature": 1.0, "seed": seed}).json()
                   for seed in (1, 2)]
    assert models[0]["kvtier_sampling_defaults"] == {
        "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
        "source": "the model's generation_config (no do_sample: greedy, as generate())"}
    assert answer["choices"][0]["message"]["content"] == expected
    assert "KV cache" in expected or "cache" in expected.lower()
    texts = [s["choices"][0]["message"]["content"] for s in sampled]
    assert texts[0] != texts[1]  # temperature 1.0 sent: sampled (two seeds), not the greedy default
