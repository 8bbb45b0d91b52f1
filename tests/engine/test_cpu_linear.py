"""The engine's CPU linear: a decode step's few rows by kvtier's kernel, more rows by oneDNN; both equal torch's."""

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine import cpu_linear as frl

pytestmark = pytest.mark.skipif(not frl.available(), reason="the kernel could not be built (no C++ compiler)")


@pytest.mark.parametrize("rows", range(1, frl.MAX_ROWS + 1))
@pytest.mark.parametrize("n, k", [(64, 576), (13, 40), (7, 5), (192, 1536)])  # tails: rows of W, K past 16 lanes
def test_equals_torch_linear(rows, n, k):
    torch.manual_seed(rows * 1000 + n + k)
    x, w, bias = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    torch.testing.assert_close(frl.few_rows_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(frl.few_rows_linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_strided_rows_and_leading_dims():
    # the flat batch [1, N, K] as the model hands it, and rows of a wider buffer (a stride between them)
    wide = torch.randn(3, 100)
    x = wide[:, :64]
    w = torch.randn(10, 64)
    torch.testing.assert_close(frl.few_rows_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)
    flat = torch.randn(1, 5, 64)
    out = frl.few_rows_linear(flat, w)
    assert out.shape == (1, 5, 10)
    torch.testing.assert_close(out, F.linear(flat, w), rtol=1e-5, atol=1e-4)


def test_more_rows_by_onednn_equal_torch_linear():
    if not frl.onednn_available():
        pytest.skip("no oneDNN in this torch")
    x, w, bias = torch.randn(1, 300, 64), torch.randn(40, 64), torch.randn(40)
    torch.testing.assert_close(frl.onednn_linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_the_module_takes_each_path_by_rows_and_dtype(monkeypatch):
    layer = torch.nn.Linear(32, 24)
    frl.use_cpu_linear(layer)
    assert type(layer) is frl.CpuLinear
    calls = []
    for name in ("few_rows_linear", "onednn_linear"):
        real = getattr(frl, name)
        monkeypatch.setattr(frl, name, lambda *a, real=real, name=name: calls.append((name, a[0].shape)) or real(*a))
    few, many = torch.randn(1, 3, 32), torch.randn(1, frl.MAX_ROWS + 1, 32)
    with torch.inference_mode():
        torch.testing.assert_close(layer(few), F.linear(few, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(layer(many), F.linear(many, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        want = [("few_rows_linear", (1, 3, 32))] + ([("onednn_linear", (1, 9, 32))] if frl.onednn_available() else [])
        assert calls == want
        layer.to(torch.bfloat16)
        layer(few.bfloat16())
        assert calls == want  # bf16: torch's path
    layer.float()
    layer(few).sum().backward()  # training: torch's path, gradients flow
    assert layer.weight.grad is not None and calls == want


def test_off_by_the_environment(monkeypatch):
    layer = torch.nn.Linear(8, 8)
    monkeypatch.setenv("KVTIER_CPU_LINEAR", "0")
    assert frl.use_cpu_linear(layer) == 0 and type(layer) is torch.nn.Linear


def test_the_engine_model_copy_takes_it_and_the_callers_model_keeps_its_linears(tiny_model):
    # (the engine's greedy tokens equal transformers' with it: test_engine, test_paged_attention, ...)
    from kvtier.engine import EngineConfig, LLMEngine

    engine = LLMEngine(tiny_model, EngineConfig(device_kv_budget_bytes=64 * tiny_model.kv_layout(8).block_bytes,
                                                block_tokens=8))
    copied = [m for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert copied and all(type(m) is frl.CpuLinear for m in copied)
    assert type(engine.runner.lm_head) is frl.CpuLinear
    assert all(type(m) is torch.nn.Linear for m in tiny_model.model.modules() if isinstance(m, torch.nn.Linear))
