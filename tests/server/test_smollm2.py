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
