"""Specs from config.json and GGUF metadata: hub-shaped configs agree with the catalog; bad files fail cleanly."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import UserError
from kvtier.models import embedded_gguf_path
from kvtier.plan import model_spec
from kvtier.plan.hf_config import sliding_layer_flags, spec_from_config

# The sizing fields of the models' published config.json files.
LLAMA_8B = {"model_type": "llama", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
            "max_position_embeddings": 131072, "tie_word_embeddings": False}
QWEN25_7B = {"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "hidden_size": 3584, "intermediate_size": 18944, "vocab_size": 152064, "max_position_embeddings": 32768,
             "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28}
GEMMA2_9B = {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 256, "hidden_size": 3584, "intermediate_size": 14336, "vocab_size": 256000,
             "max_position_embeddings": 8192, "sliding_window": 4096, "tie_word_embeddings": True}
GPT_OSS_120B = {"model_type": "gpt_oss", "num_hidden_layers": 36, "num_attention_heads": 64,
                "num_key_value_heads": 8, "head_dim": 64, "hidden_size": 2880, "intermediate_size": 2880,
                "vocab_size": 201088, "max_position_embeddings": 131072, "sliding_window": 128,
                "num_local_experts": 128, "num_experts_per_tok": 4,
                "layer_types": ["sliding_attention", "full_attention"] * 18}
MIXTRAL = {"model_type": "mixtral", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 32000, "sliding_window": None,
           "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768}
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "vocab_size": 129280, "max_position_embeddings": 163840,
               "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
               "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
               "v_head_dim": 128}


@pytest.mark.parametrize("config,name", [(LLAMA_8B, "llama-3.1-8b"), (QWEN25_7B, "qwen2.5-7b"),
                                         (GEMMA2_9B, "gemma-2-9b"), (GPT_OSS_120B, "gpt-oss-120b"),
                                         (MIXTRAL, "mixtral-8x7b"), (DEEPSEEK_V3, "deepseek-v3")])
def test_config_json_gives_the_catalog_kv(config, name, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec, catalog = model_spec(str(tmp_path)), model_spec(name)
    for context in (100, 5000, 131072):
        assert spec.kv_bytes(context, "bf16", tp=2) == catalog.kv_bytes(context, "bf16", tp=2)
    assert spec.params_total == pytest.approx(catalog.params_total, rel=0.02)
    assert spec.params_active == pytest.approx(catalog.params_active, rel=0.12)  # cards differ on embeddings


def test_param_estimate_arithmetic():
    # llama-3.1-8b: 32 x (attention 4096*128*(2*32 + 2*8) + MLP 3*4096*14336) + 2 untied embeddings
    assert spec_from_config(LLAMA_8B).params_total == 32 * (4096 * 128 * 80 + 3 * 4096 * 14336) + 2 * 128256 * 4096
    # mixtral: 8 experts, 2 active, a 4096x8 router per layer
    attn, expert, router = 4096 * 128 * 80, 3 * 4096 * 14336, 4096 * 8
    spec = spec_from_config(MIXTRAL)
    assert spec.params_total == 32 * (attn + 8 * expert + router) + 2 * 32000 * 4096
    assert spec.params_active == 32 * (attn + 2 * expert + router) + 2 * 32000 * 4096
    # deepseek-v3 MLA attention: q_a, q_b, kv_a (latent + rope), kv_b, o
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    moe_expert = 3 * 7168 * 2048
    ds = spec_from_config(DEEPSEEK_V3)
    assert ds.params_total == (61 * mla + 3 * 3 * 7168 * 18432 + 58 * (257 * moe_expert + 7168 * 256)
                               + 2 * 129280 * 7168)  # 671.0e9
    assert round(ds.params_total / 1e9) == 671


def test_gemma2_hub_config_alternates_without_layer_types():
    flags = sliding_layer_flags(GEMMA2_9B, 42)
    assert flags[:4] == [True, False, True, False] and sum(flags) == 21


def test_qwen_use_sliding_window_false_is_not_windowed():
    spec = spec_from_config(QWEN25_7B)
    assert spec.sliding_window is None and spec.num_sliding_layers == 0
    assert spec.kv_bytes(32768) == 2 * 28 * 4 * 128 * 2 * 32768
    # switched on, Qwen2 slides only on layers >= max_window_layers (transformers' rule)
    on = {**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20}
    spec = spec_from_config(on)
    assert spec.num_sliding_layers == 8
    assert spec.kv_bytes(32768) == 2 * 4 * 128 * 2 * (20 * 32768 + 8 * 4095)


def test_mistral_v01_window_slides_on_every_layer():
    spec = spec_from_config({**LLAMA_8B, "model_type": "mistral", "sliding_window": 4096})
    assert spec.num_sliding_layers == 32 and spec.kv_bytes(32768) == 2 * 32 * 8 * 128 * 2 * 4095


def test_gemma3_pattern_and_text_config():
    config = {"model_type": "gemma3", "text_config": {**GEMMA2_9B, "model_type": "gemma3_text",
                                                      "num_hidden_layers": 12, "sliding_window": 1024}}
    spec = spec_from_config(config)  # every 6th layer global
    assert spec.num_sliding_layers == 10 and spec.sliding_window == 1024


def test_head_dim_from_config_when_given(tmp_path):
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
              "head_dim": 96, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = model_spec(str(tmp_path / "config.json"))
    assert spec.head_dim == 96 and spec.num_sliding_layers == 2
    assert spec.kv_bytes(100, "fp16") == 2 * 2 * 96 * 2 * (2 * 100 + 2 * 15)


def test_gguf_metadata():
    spec = model_spec(str(embedded_gguf_path()))
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert (spec.hidden_size, spec.intermediate_size, spec.vocab_size) == (576, 1536, 49152)
    assert spec.max_context == 8192 and spec.kv_bytes_per_token("bf16") == 23040
    assert spec.params_total == 134_515_008  # counted from the tensor shapes (tied embeddings)


@pytest.mark.parametrize("content,message", [
    ({"hidden_size": 64}, "lacks 'num_hidden_layers'"),
    ({**LLAMA_8B, "num_key_value_heads": "eight"}, "'num_key_value_heads' must be an integer"),
    ({**LLAMA_8B, "num_attention_heads": 0}, "'num_attention_heads' must be positive"),
    ({**LLAMA_8B, "hidden_size": -4096}, "'hidden_size' must be positive"),
    ({**GPT_OSS_120B, "layer_types": ["full_attention"]}, "1 layer_types for 36 layers"),
    ([1, 2, 3], "not a JSON object"),
])
def test_bad_config_json_is_a_user_error(content, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(content))
    with pytest.raises(UserError, match=message):
        model_spec(str(tmp_path / "config.json"))


def test_bad_files_are_user_errors(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "fake.gguf").write_bytes(b"GGUF" + b"\0" * 12)
    (tmp_path / "empty").mkdir()
    for path, message in [(tmp_path / "broken.json", "not a JSON config"), (tmp_path / "fake.gguf", "not a readable GGUF"),
                          (tmp_path / "empty", "has no config.json"), (tmp_path / "gone.json", "no such model file")]:
        with pytest.raises(UserError, match=message):
            model_spec(str(path))
