"""The KV formula against hand-computed values for each catalog family, and the known traps."""

from __future__ import annotations

import pytest

from kvtier.plan import model_spec


@pytest.mark.parametrize("name,per_token", [
    # 2 (K and V) x layers x KV heads x head_dim x 2 bytes (bf16)
    ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),      # 131072
    ("llama-3.1-70b", 2 * 80 * 8 * 128 * 2),     # 327680
    ("llama-3.1-405b", 2 * 126 * 8 * 128 * 2),   # 516096
    ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),        # 57344
    ("qwen2.5-72b", 2 * 80 * 8 * 128 * 2),       # 327680
    ("mistral-7b", 2 * 32 * 8 * 128 * 2),        # 131072
    ("mixtral-8x7b", 2 * 32 * 8 * 128 * 2),      # MoE: the experts do not change the KV
    ("smollm2-135m", 2 * 30 * 3 * 64 * 2),       # 23040
])
def test_full_attention_families(name, per_token):
    spec = model_spec(name)
    assert spec.kv_bytes_per_token("bf16") == per_token
    assert spec.kv_bytes(1000, "bf16") == per_token * 1000


def test_gemma_2_family():
    # 8192 tokens: 21 global layers hold 8192, 21 local layers hold window - 1 = 4095
    assert model_spec("gemma-2-9b").kv_bytes(8192) == 2 * 8 * 256 * 2 * (21 * 8192 + 21 * 4095)
    assert model_spec("gemma-2-27b").kv_bytes(8192) == 2 * 16 * 128 * 2 * (23 * 8192 + 23 * 4095)
    # below the window every layer holds every token
    assert model_spec("gemma-2-27b").kv_bytes(1000) == 2 * 16 * 128 * 2 * 46 * 1000


def test_deepseek_v3_family():
    spec = model_spec("deepseek-v3")
    assert spec.kv_bytes(1000, "bf16") == 61 * (512 + 64) * 2 * 1000    # 70272 B per token


def test_gpt_oss_family():
    spec = model_spec("gpt-oss-120b")  # 18 full layers + 18 layers of a 128-token window
    assert spec.kv_bytes(131072, "bf16") == 2 * 8 * 64 * 2 * (18 * 131072 + 18 * 127)


def test_trap_kv_heads_not_attention_heads():
    spec = model_spec("llama-3.1-70b")  # 64 attention heads, 8 KV heads
    assert (spec.num_heads, spec.num_kv_heads) == (64, 8)
    assert spec.kv_bytes(1, "bf16") == 2 * 80 * 8 * 128 * 2
    assert spec.kv_bytes(1, "bf16") * 8 == 2 * 80 * 64 * 128 * 2  # what counting query heads would say


def test_trap_gemma_head_dim_is_not_hidden_over_heads():
    spec = model_spec("gemma-2-9b")
    assert spec.hidden_size // spec.num_heads == 224 and spec.head_dim == 256
    assert spec.kv_bytes(100) == 2 * 42 * 8 * 256 * 2 * 100  # not 224


def test_trap_mla_is_one_latent_per_layer_no_x2_replicated_over_tp():
    spec = model_spec("deepseek-v3")  # config says 128 KV heads; MLA caches none of them
    per_token = 61 * (512 + 64) * 2
    assert spec.kv_bytes_per_token("bf16") == per_token
    assert per_token != 2 * 61 * 128 * 128 * 2 and per_token != 2 * 61 * (512 + 64) * 2
    assert spec.kv_bytes_per_token("bf16", tp=8) == per_token  # every rank holds the whole latent


def test_trap_sliding_layers_stop_growing_at_the_window():
    spec = model_spec("gemma-2-9b")
    growth = spec.kv_bytes(1_000_000) - spec.kv_bytes(500_000)
    assert growth == 2 * 8 * 256 * 2 * 21 * 500_000  # only the 21 global layers grow


def test_tp_shards_kv_heads_and_replicates_beyond():
    spec = model_spec("llama-3.1-8b")  # 8 KV heads
    assert spec.kv_bytes_per_token("bf16", tp=2) == 2 * 32 * 4 * 128 * 2
    assert spec.kv_bytes_per_token("bf16", tp=8) == 2 * 32 * 1 * 128 * 2
    assert spec.kv_bytes_per_token("bf16", tp=16) == 2 * 32 * 1 * 128 * 2  # one head each, replicated
    assert model_spec("qwen2.5-7b").kv_bytes_per_token("bf16", tp=8) == 2 * 28 * 1 * 128 * 2  # 4 heads


def test_quantized_kv_counts_scale_overhead():
    spec = model_spec("llama-3.1-8b")
    elems = 2 * 32 * 8 * 128
    assert spec.kv_bytes_per_token("fp16") == elems * 2
    assert spec.kv_bytes_per_token("fp8") == elems * 1
    assert spec.kv_bytes_per_token("int8") == elems * (1 + 4 / 128)      # fp16 scale + zero per head-token
    assert spec.kv_bytes_per_token("int4") == elems * (0.5 + 4 / 32)     # fp16 scale + zero per 32 elements
    assert model_spec("deepseek-v3").kv_bytes_per_token("int8") == 61 * 576 * (1 + 4 / 576)


def test_weights_count_every_expert_and_flops_the_active_ones():
    mixtral = model_spec("mixtral-8x7b")
    assert mixtral.weights_bytes("bf16") == 46.7e9 * 2
    assert mixtral.weights_bytes("int4") == 46.7e9 * (0.5 + 2 / 128)
    assert mixtral.flops_per_token == 2 * 12.9e9
    assert model_spec("llama-3.1-8b").weights_bytes("fp8") == 8.03e9
