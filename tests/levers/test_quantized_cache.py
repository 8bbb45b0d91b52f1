"""The resident quantized cache's window logic, with an injected per-token int8 quantizer.

(The codecs' own error bounds are tested with `kvtier.codecs.quant`.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvtier.levers.quantized_cache import QuantizedKVCache, QuantizedKVLayer


class AbsmaxInt8:
    """Per-token symmetric int8: payload int8 [B, H, T, D] + one fp32 scale per token."""

    def quantize_keys(self, x):
        return self.quantize_values(x)

    def quantize_values(self, x):
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
        return (x / scale).round().to(torch.int8), scale

    def dequantize(self, packed, dtype):
        q, scale = packed
        return (q.float() * scale).to(dtype)

    def nbytes(self, packed):
        return packed[0].numel() + packed[1].numel() * 4


def _kv(t: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g)


def test_recent_tokens_stay_full_precision_until_a_block_fills():
    layer = QuantizedKVLayer(AbsmaxInt8(), residual_tokens=4)
    k, v = _kv(10)
    layer.update(k[..., :6, :], v[..., :6, :])
    keys, values = layer.update(k[..., 6:, :], v[..., 6:, :])
    assert [b.num_tokens for b in layer.blocks] == [4, 4]
    assert layer.get_seq_length() == 10
    assert torch.equal(layer.keys, k[..., 8:, :]) and torch.equal(layer.values, v[..., 8:, :])
    # what attention saw: dequantized first 4 tokens, exact tokens 4..9 (6, 7 were still residual)
    assert torch.equal(keys[..., 4:, :], k[..., 4:, :]) and torch.equal(values[..., 4:, :], v[..., 4:, :])
    assert not torch.equal(keys[..., :4, :], k[..., :4, :])
    assert torch.allclose(keys[..., :4, :], k[..., :4, :], atol=k.abs().max().item() / 127)
    next_keys, _ = layer.update(*_kv(1, seed=1))
    assert torch.equal(next_keys[..., 8:10, :], k[..., 8:, :])
    assert not torch.equal(next_keys[..., 4:8, :], k[..., 4:8, :])  # tokens 4..7 are now a block


def test_nbytes_counts_payload_scales_and_residual():
    layer = QuantizedKVLayer(AbsmaxInt8(), residual_tokens=4)
    layer.update(*_kv(6))
    # one block: 2 x (2*4*8 int8 + 2*4 fp32 scales); residual 2 tokens x 2 x 2 heads x 8 at 2 bytes
    assert layer.nbytes(2) == 2 * (64 + 8 * 4) + 2 * 2 * 2 * 8 * 2


def test_nan_or_inf_is_rejected_with_a_clear_error():
    layer = QuantizedKVLayer(AbsmaxInt8(), residual_tokens=2)
    k, v = _kv(2)
    k[0, 0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        layer.update(k, v)
    k, v = _kv(2)
    v[0, 1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        QuantizedKVLayer(AbsmaxInt8(), residual_tokens=2).update(k, v)


def test_generation_runs_and_short_prompts_match_dynamic_cache(tiny_model):
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    ref = tiny_model.model.generate(ids, max_new_tokens=5, do_sample=False,
                                    past_key_values=DynamicCache(config=tiny_model.config))
    # nothing reaches a full 128-token block: all full precision, identical tokens
    cache = QuantizedKVCache(tiny_model.config, "int8", quantizer=AbsmaxInt8())
    out = tiny_model.model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)
    cache = QuantizedKVCache(tiny_model.config, "int8", residual_tokens=8, quantizer=AbsmaxInt8())
    out = tiny_model.model.generate(ids, max_new_tokens=5, do_sample=False, past_key_values=cache)
    assert out.shape == (1, 25)
    assert cache.get_seq_length() == 24 and [b.num_tokens for b in cache.layers[0].blocks] == [8, 8, 8]
