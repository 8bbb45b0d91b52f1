"""The few-rows linear kernel: a decode step's `x @ W^T` on the CPU, equal to torch's `linear`."""

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine import few_rows_linear as frl

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


def test_the_module_takes_the_kernel_only_for_a_few_fp32_rows(monkeypatch):
    layer = torch.nn.Linear(32, 24)
    layer.__class__ = frl.FewRowsLinear
    calls = []
    kernel = frl.few_rows_linear
    monkeypatch.setattr(frl, "few_rows_linear", lambda *a: calls.append(a[0].shape) or kernel(*a))
    few, many = torch.randn(1, 3, 32), torch.randn(1, frl.MAX_ROWS + 1, 32)
    with torch.inference_mode():
        torch.testing.assert_close(layer(few), F.linear(few, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert torch.equal(layer(many), F.linear(many, layer.weight, layer.bias))  # torch's own path
        assert calls == [(1, 3, 32)]
        layer.to(torch.bfloat16)
        layer(few.bfloat16())
        assert calls == [(1, 3, 32)]  # bf16: torch's path
    layer.float()
    layer(few).sum().backward()  # training: torch's path, gradients flow
    assert layer.weight.grad is not None and calls == [(1, 3, 32)]


def test_the_engine_model_copy_takes_it_and_the_callers_model_keeps_its_linears(tiny_model):
    # (the engine's greedy tokens equal transformers' with it: test_engine, test_paged_attention, ...)
    from kvtier.engine import EngineConfig, LLMEngine

    engine = LLMEngine(tiny_model, EngineConfig(device_kv_budget_bytes=64 * tiny_model.kv_layout(8).block_bytes,
                                                block_tokens=8))
    copied = [m for m in engine.runner.model.modules() if isinstance(m, torch.nn.Linear)]
    assert copied and all(type(m) is frl.FewRowsLinear for m in copied)
    assert type(engine.runner.lm_head) is frl.FewRowsLinear
    assert all(type(m) is torch.nn.Linear for m in tiny_model.model.modules() if isinstance(m, torch.nn.Linear))
