"""The engine on the real SmolLM2: several concurrent chats with a shared system prompt, on a tight
device budget, give token for token the text of `model.generate` with DynamicCache."""

import sys
from pathlib import Path

import pytest

from kvtier.engine import EngineConfig, LLMEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402

pytestmark = pytest.mark.smollm2


def test_concurrent_greedy_equals_generate(smollm2, shakespeare_text):
    tok = smollm2.tokenizer
    system = shakespeare_text[:600]
    questions = ["Who speaks first?", "Summarize the scene in one line.", "What city is this?"]
    prompts = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                       add_generation_prompt=True, tokenize=True, return_dict=False) for q in questions]
    prompts.append(tok(shakespeare_text[2000:2300])["input_ids"])
    new = 24
    refs = [reference(smollm2.model, p, new) for p in prompts]
    layout = smollm2.kv_layout(16)
    longest = max(len(p) for p in prompts) + new
    # room for two of the four: requests queue for admission and share the system prompt's blocks
    num_blocks = 2 * -(-longest // 16)
    engine = LLMEngine(smollm2, EngineConfig(device_kv_budget_bytes=num_blocks * layout.block_bytes,
                                             block_tokens=16, max_prefill_tokens=64))
    got = engine.generate(prompts, SamplingParams(max_tokens=new))
    assert [tok.decode(g) for g in got] == [tok.decode(r) for r in refs]
    assert got == refs
    stats = engine.stats()
    assert stats.prefix_hit_tokens_by_tier.get("device", 0) > 0  # the shared system prompt
