"""The resident quantized cache's window logic, with an injected per-token int8 quantizer.

(The codecs' own error bounds are tested with `kvtier.codecs.quant`.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvtier.codecs import quant
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


# -- the real codecs (kvtier.codecs.quant) through the cache -----------------------------------

REAL_CODECS = ["fp8", "int8", "int4", "int2"]


def _prefill_keys(model, ids: torch.Tensor, cache) -> None:
    with torch.inference_mode():
        model.model(ids, past_key_values=cache)


@pytest.mark.parametrize("codec", REAL_CODECS)
def test_blocks_hold_exactly_the_codec_quantization_of_the_prefill(tiny_model, codec):
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    ref = DynamicCache(config=tiny_model.config)
    _prefill_keys(tiny_model, ids, ref)
    cache = QuantizedKVCache(tiny_model.config, codec, residual_tokens=16)
    _prefill_keys(tiny_model, ids, cache)
    q = quant.quantizer(codec)
    # layer 0's K/V depend only on the tokens, so they equal the full-precision run's
    layer, keys, values = cache.layers[0], ref.layers[0].keys, ref.layers[0].values
    assert [b.num_tokens for b in layer.blocks] == [16, 16]
    for i, block in enumerate(layer.blocks):
        span = slice(16 * i, 16 * (i + 1))
        assert torch.equal(q.dequantize(block.keys, torch.float32),
                           q.dequantize(q.quantize_keys(keys[..., span, :]), torch.float32))
        assert torch.equal(q.dequantize(block.values, torch.float32),
                           q.dequantize(q.quantize_values(values[..., span, :]), torch.float32))
    assert torch.equal(layer.keys, keys[..., 32:, :]) and torch.equal(layer.values, values[..., 32:, :])


def test_int4_nbytes_is_the_kivi_formula(tiny_model):
    cache = QuantizedKVCache(tiny_model.config, "int4", residual_tokens=16)
    _prefill_keys(tiny_model, torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2)), cache)
    # per layer, per 16-token block of [1, 2 heads, 16, 16]: 512 4-bit codes = 256 bytes for K and for V;
    # K: fp16 scale + min per channel per head (2*16 groups); V: per token per head (2*16 groups)
    block_bytes = 2 * (256 + 2 * 2 * 32)
    residual_bytes = 8 * 2 * 2 * 16 * 2          # 8 tokens, K and V, 2 heads, head_dim 16, 16-bit
    assert cache.nbytes(2) == tiny_model.config.num_hidden_layers * (2 * block_bytes + residual_bytes)


def test_generation_with_each_codec_end_to_end_and_error_grows_as_bits_shrink(tiny_model):
    ids = torch.randint(0, 256, (1, 60), generator=torch.Generator().manual_seed(3))
    nxt = torch.tensor([[7]])

    def next_logits(cache) -> torch.Tensor:
        with torch.inference_mode():
            tiny_model.model(ids, past_key_values=cache)
            return tiny_model.model(nxt, past_key_values=cache).logits[0, -1]

    ref = next_logits(DynamicCache(config=tiny_model.config))
    errors = {}
    for codec in REAL_CODECS:
        cache = QuantizedKVCache(tiny_model.config, codec, residual_tokens=16)
        errors[codec] = float((next_logits(cache) - ref).abs().max())
        out = tiny_model.model.generate(ids, max_new_tokens=8, do_sample=False,
                                        past_key_values=QuantizedKVCache(tiny_model.config, codec,
                                                                         residual_tokens=16))
        assert out.shape == (1, 68) and torch.equal(out[:, :60], ids)
    assert 0 < errors["int8"] < errors["int4"] < errors["int2"]
    assert errors["fp8"] < errors["int4"]


@pytest.mark.parametrize("codec", REAL_CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_real_codecs_reject_nan_inf_and_leave_the_layer_unchanged(codec, bad):
    layer = QuantizedKVLayer(quant.quantizer(codec), residual_tokens=4)
    k, v = _kv(3)
    layer.update(k, v)
    bad_k, bad_v = _kv(2, seed=1)
    (bad_k if bad != float("-inf") else bad_v)[0, 1, 0, 5] = bad
    with pytest.raises(ValueError, match="NaN|inf"):
        layer.update(bad_k, bad_v)
    assert layer.blocks == [] and layer.get_seq_length() == 3
    assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
