"""kvtier plan: the formula against hand-computed values, the known traps, and bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache

from kvtier.cli import main
from kvtier.errors import UserError
from kvtier.models import embedded_gguf_path
from kvtier.plan import gpu_spec, model_spec, plan
from kvtier.plan.catalog import spec_from_config


@pytest.mark.parametrize("name,per_token", [
    # 2 (K,V) x layers x kv heads x head_dim x 2 bytes (bf16)
    ("llama-3.1-8b", 2 * 32 * 8 * 128 * 2),      # 131072
    ("llama-3.1-70b", 2 * 80 * 8 * 128 * 2),     # 327680
    ("llama-3.1-405b", 2 * 126 * 8 * 128 * 2),   # 516096
    ("qwen2.5-7b", 2 * 28 * 4 * 128 * 2),        # 57344
    ("qwen2.5-72b", 2 * 80 * 8 * 128 * 2),
    ("mistral-7b", 2 * 32 * 8 * 128 * 2),
    ("mixtral-8x7b", 2 * 32 * 8 * 128 * 2),      # MoE: experts don't change KV
    ("smollm2-135m", 2 * 30 * 3 * 64 * 2),       # 23040
])
def test_full_attention_kv_per_token(name, per_token):
    spec = model_spec(name)
    assert spec.kv_bytes_per_token("bf16") == per_token
    assert spec.kv_bytes(1000, "bf16") == per_token * 1000


def test_trap_kv_heads_not_attention_heads():
    spec = model_spec("llama-3.1-70b")  # 64 attention heads, 8 KV heads
    assert spec.kv_bytes(1, "bf16") == 2 * 80 * 8 * 128 * 2
    assert spec.kv_bytes(1, "bf16") != 2 * 80 * 64 * 128 * 2


def test_trap_gemma_head_dim_is_not_hidden_over_heads():
    spec = model_spec("gemma-2-9b")
    assert spec.hidden_size // spec.num_heads == 224 and spec.head_dim == 256
    # 4096-token context: 21 global layers hold 4096 tokens, 21 local layers hold window-1 = 4095
    assert spec.kv_bytes(4096, "bf16") == 2 * 8 * 256 * 2 * (21 * 4096 + 21 * 4095)


def test_trap_sliding_layers_stop_growing_at_the_window():
    spec = model_spec("gemma-2-27b")
    per_layer_token = 2 * 16 * 128 * 2
    assert spec.kv_bytes(8192, "bf16") == per_layer_token * (23 * 8192 + 23 * 4095)
    oss = model_spec("gpt-oss-120b")  # 18 full layers + 18 layers of a 128-token window
    assert oss.kv_bytes(131072, "bf16") == 2 * 8 * 64 * 2 * (18 * 131072 + 18 * 127)


def test_trap_mla_is_one_latent_per_layer_no_x2_replicated_over_tp():
    spec = model_spec("deepseek-v3")
    assert spec.kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2  # 70272 bytes
    assert spec.kv_bytes_per_token("bf16", tp=8) == 61 * (512 + 64) * 2


def test_trap_qwen_use_sliding_window_false_is_not_windowed():
    config = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
              "intermediate_size": 18944, "vocab_size": 152064, "sliding_window": 4096, "use_sliding_window": False,
              "max_position_embeddings": 32768}
    spec = spec_from_config(config, "qwen")
    assert spec.sliding_window is None and spec.kv_bytes(32768) == 2 * 28 * 4 * 128 * 2 * 32768
    windowed = spec_from_config({**config, "use_sliding_window": True}, "qwen-swa")
    assert windowed.kv_bytes(32768) == 2 * 28 * 4 * 128 * 2 * 4095


def test_config_json_with_layer_types(tmp_path):
    config = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 512,
              "head_dim": 96, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = model_spec(str(tmp_path))
    assert spec.head_dim == 96 and spec.num_sliding_layers == 2
    assert spec.kv_bytes(100, "fp16") == 2 * 2 * 96 * 2 * (2 * 100 + 2 * 15)


def test_config_json_missing_fields_is_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(UserError, match="num_hidden_layers"):
        model_spec(str(tmp_path / "config.json"))


def test_gguf_metadata():
    spec = model_spec(str(embedded_gguf_path()))
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert spec.max_context == 8192 and spec.kv_bytes_per_token("bf16") == 23040


def test_tp_shards_kv_heads_and_replicates_beyond():
    spec = model_spec("llama-3.1-8b")  # 8 KV heads
    assert spec.kv_bytes_per_token("bf16", tp=2) == 2 * 32 * 4 * 128 * 2
    assert spec.kv_bytes_per_token("bf16", tp=8) == 2 * 32 * 1 * 128 * 2
    assert spec.kv_bytes_per_token("bf16", tp=16) == 2 * 32 * 1 * 128 * 2  # replicated
    assert "replicated" in " ".join(plan(spec, gpu_spec("h100"), context=1024, concurrency=1, tp=16).notes)


def test_quantized_kv_counts_scale_overhead():
    spec = model_spec("llama-3.1-8b")
    elems = 2 * 32 * 8 * 128
    assert spec.kv_bytes_per_token("fp8") == elems * 1
    assert spec.kv_bytes_per_token("int8") == elems * (1 + 4 / 128)
    assert spec.kv_bytes_per_token("int4") == elems * (0.5 + 4 / 32)


def test_budget_line_and_derived_answers():
    spec, gpu = model_spec("llama-3.1-8b"), gpu_spec("h100")
    r = plan(spec, gpu, context=131072, concurrency=16)
    kv_req = 131072 * 131072  # bytes per token x tokens = 16 GiB per request
    assert r.kv_bytes_per_request == kv_req and r.kv_bytes_total == 16 * kv_req
    assert r.weights_bytes == 8.03e9 * 2
    assert r.needed_bytes_per_gpu == r.weights_bytes + 16 * kv_req + r.activations_bytes + r.overhead_bytes
    assert not r.fits
    assert r.max_concurrency == int(r.kv_capacity_bytes_per_gpu // kv_req)
    assert r.max_context == int(r.kv_capacity_bytes_per_gpu // (16 * 131072))
    assert r.spill_bytes == pytest.approx(16 * kv_req - r.kv_capacity_bytes_per_gpu)
    assert r.replicas == math.ceil(16 / r.max_concurrency) and r.nodes == math.ceil(r.gpus / 8)
    assert r.facility_watts == (r.gpus * 700 * 2.5, r.gpus * 700 * 3.0)
    small = plan(spec, gpu, context=4096, concurrency=4)
    assert small.fits and small.spill_bytes == 0


def _run(*args) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args])
    assert exc.value.code == 0


def _cli_json(capsys, *args):
    _run(*args, "--json")
    return json.loads(capsys.readouterr().out)


def test_cli_json_keys(capsys):
    out = _cli_json(capsys, "--model", "llama-3.1-70b", "--context", "128k", "--concurrency", "32", "--tp", "8")
    for key in ("kv_bytes_per_token", "kv_bytes_total", "weights_bytes", "fits", "max_concurrency", "max_context",
                "spill_bytes"):
        assert key in out
    assert out["context"] == 131072 and out["kv_bytes_per_token"] == 327680 / 8


def test_cli_gpu_mem_and_plot(tmp_path, capsys):
    png = tmp_path / "mem.png"
    out = _cli_json(capsys, "--model", "smollm2", "--gpu-mem", "8GB", "--plot", str(png))
    assert out["gpu_mem_bytes"] == 8 * 10**9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_table_prints_units(capsys):
    _run("--model", "smollm2", "--context", "8k", "--concurrency", "4")
    out = capsys.readouterr().out
    assert "GiB" in out and "GB" in out and "fits" in out


@pytest.mark.parametrize("args,message", [
    (["--model", "gpt-17"], "unknown model"),
    (["--model", "smollm2", "--gpu", "tpu-v9"], "unknown GPU"),
    (["--model", "smollm2", "--context", "-5"], "cannot parse"),
    (["--model", "smollm2", "--context", "lots"], "cannot parse"),
    (["--model", "smollm2", "--kv-dtype", "int3"], "unknown KV dtype"),
    (["--model", "smollm2", "--tp", "0"], "positive"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def _measured_kv_bytes(loaded, num_tokens: int) -> int:
    cache = DynamicCache(config=loaded.config)
    ids = torch.randint(0, loaded.config.vocab_size, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        loaded.model(ids, past_key_values=cache, use_cache=True)
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@pytest.mark.parametrize("num_tokens", [30, 64, 100])
def test_plan_equals_measured_kv_of_tiny_sliding_window_model(tiny_swa_model, tmp_path, num_tokens):
    tiny_swa_model.config.to_json_file(tmp_path / "config.json")
    spec = model_spec(str(tmp_path / "config.json"))
    assert spec.kv_bytes(num_tokens, "fp32") == _measured_kv_bytes(tiny_swa_model, num_tokens)


@pytest.mark.smollm2
@pytest.mark.parametrize("num_tokens", [1, 257, 1000])
def test_plan_equals_measured_kv_of_smollm2(smollm2, num_tokens):
    assert model_spec("smollm2").kv_bytes(num_tokens, "fp32") == _measured_kv_bytes(smollm2, num_tokens)
