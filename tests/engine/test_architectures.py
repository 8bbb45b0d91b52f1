"""The paged attention path on other HF decoder families (random tiny weights): Qwen2 (qkv bias),
Qwen3 (q/k norms), and the refusal of sliding-window models."""

import hashlib
import sys
from pathlib import Path

import pytest
import torch

from kvtier.engine import EngineConfig, LLMEngine, SamplingParams
from kvtier.models import LoadedModel

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402


def tiny(family: str) -> LoadedModel:
    import transformers

    config_cls = getattr(transformers, f"{family}Config")
    model_cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(0)
    config = config_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        tie_word_embeddings=False, use_sliding_window=False)
    name = f"tiny-{family}"
    return LoadedModel(model_cls(config).eval(), None, name, hashlib.sha256(name.encode()).hexdigest()[:16])


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
def test_other_families_match_generate(family, tiny_prompts):
    loaded = tiny(family)
    refs = [reference(loaded.model, p, 12) for p in tiny_prompts[:4]]
    engine = LLMEngine(loaded, EngineConfig(device_kv_budget_bytes=32 * loaded.kv_layout(8).block_bytes,
                                            block_tokens=8, max_prefill_tokens=16))
    assert engine.generate(tiny_prompts[:4], SamplingParams(max_tokens=12)) == refs


def test_sliding_window_models_are_refused(tiny_swa_model):
    with pytest.raises(ValueError, match="sliding-window"):
        LLMEngine(tiny_swa_model, EngineConfig(device_kv_budget_bytes=1 << 20, block_tokens=8))
