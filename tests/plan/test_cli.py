"""kvtier plan end to end: the HBM budget line, the CLI (JSON, table, plot, bad input), and the
formula against the KV bytes a real DynamicCache holds."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache

from kvtier.cli import main
from kvtier.plan import gpu_spec, model_spec, plan


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


LLAMA70 = ["--model", "llama-3.1-70b", "--context", "128k", "--concurrency", "32", "--gpu", "h100"]


def test_no_tp_chooses_the_smallest_that_holds_weights_and_a_request(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")  # rich wraps the table at the terminal's width
    # bf16 weights 141.2 GB: tp1 cannot hold them; tp2 holds them but leaves 4.27 GB beside them, less than one
    # request's 21.47 GB of KV; tp4 leaves 39.8 GB: 3 requests of 10.74 GB per replica, 11 replicas for 32
    out = _cli_json(capsys, *LLAMA70)
    assert (out["tp"], out["tp_chosen"], out["max_concurrency"]) == (4, True, 3)
    assert (out["cluster_tp"], out["replicas"], out["gpus"], out["nodes"]) == (4, 11, 44, 6)
    _run(*LLAMA70)
    table = capsys.readouterr().out
    assert "11 replicas x tp4 = 44 GPUs = 6 nodes" in table and "tp4 chosen" in table and " 0 GPUs" not in table


def test_tp_too_small_for_the_weights_is_one_line_naming_the_tp_that_holds_them(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", *LLAMA70, "--tp", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "weights need tp >= 2 on h100" in err


def test_tp_that_holds_weights_but_no_request_sizes_the_cluster_at_the_tp_that_does(capsys):
    out = _cli_json(capsys, *LLAMA70, "--tp", "2")
    assert (out["tp"], out["tp_chosen"], out["max_concurrency"]) == (2, False, 0)
    assert (out["cluster_tp"], out["replicas"], out["gpus"], out["nodes"]) == (4, 11, 44, 6)


def test_no_tp_holds_a_request_says_so_instead_of_zero_gpus(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "300")
    out = _cli_json(capsys, "--model", "llama-3.1-8b", "--context", "10000k")
    assert (out["tp"], out["replicas"], out["gpus"]) == (1, 0, 0)
    _run("--model", "llama-3.1-8b", "--context", "10000k")
    table = capsys.readouterr().out
    assert "0 GPUs" not in table and "none: no tensor-parallel size holds one" in table


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
