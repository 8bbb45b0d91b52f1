"""The quantizers' error bounds, derived from their math (see kvtier/codecs/quant.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kv_strategies import make_tensor, tensors
from kvtier.codecs import quant
from kvtier.codecs.quant import (dequantize, group_layout, pack_bits, quantize_fp8, quantize_groups, quantize_int8,
                                 quantize_kivi_keys, quantize_kivi_values, unpack_bits)

FP32_EPS = 2.0**-23


def per_element(q: quant.QuantizedTensor, t: torch.Tensor) -> torch.Tensor:
    """A per-group tensor (scale/zero shaped) broadcast back to q's original shape."""
    padded, grouped, _ = group_layout(q.shape, q.dim, q.group)
    return t.float().expand(grouped).reshape(padded).narrow(q.dim, 0, q.shape[q.dim])


def group_stat(x: torch.Tensor, q: quant.QuantizedTensor, reduce) -> torch.Tensor:
    padded, grouped, _ = group_layout(q.shape, q.dim, q.group)
    xp = torch.cat([x, x.narrow(q.dim, x.shape[q.dim] - 1, 1).expand(
        *[p - s if i == len(padded) + q.dim else s for i, (p, s) in enumerate(zip(padded, x.shape))])], q.dim)
    return reduce(xp.reshape(grouped), q.dim)


def fp16_spacing(v: torch.Tensor) -> torch.Tensor:
    h = v.abs().half()
    return (torch.nextafter(h, torch.full_like(h, math.inf)).float() - h.float())


def assert_int_bounds(x: torch.Tensor, q: quant.QuantizedTensor) -> None:
    xf = x.float()
    err = (dequantize(q, torch.float32) - xf).abs()
    levels = 2**q.bits - 1
    scale, zero = per_element(q, q.scale), per_element(q, q.zero)
    # |x̂ - x| <= s/2, up to fp32 rounding of (x - m)/s and q·s + m
    slack = 4 * FP32_EPS * (xf.abs() + zero.abs() + levels * scale)
    assert bool((err <= scale / 2 + slack).all()), float((err - scale / 2).max())
    # ...and s is the ideal (max - min)/(2^b - 1), widened only by fp16 storage of s and m
    mx = group_stat(xf, q, lambda t, d: t.amax(d, keepdim=True))
    mn = group_stat(xf, q, lambda t, d: t.amin(d, keepdim=True))
    bound = (mx - mn + 2 * fp16_spacing(mn)) / levels * (1 + 2.0**-10) + 2.0**-24
    assert bool((q.scale.float() <= bound).all())
    assert bool((q.zero.float() <= mn).all())  # the min rounds down: no value falls below the range


@settings(max_examples=60, deadline=None)
@given(x=tensors(), bits=st.sampled_from([2, 4]), group_tokens=st.sampled_from([1, 7, 32, 64]))
def test_kivi_keys_per_channel_error_is_at_most_half_a_step(x, bits, group_tokens):
    q = quantize_kivi_keys(x, bits, group_tokens)
    *lead, t, d = x.shape
    num_groups = -(-t // min(group_tokens, t))
    assert q.scale.shape == q.zero.shape == (*lead, num_groups, 1, d)  # one (scale, min) per channel per group
    assert_int_bounds(x, q)


@settings(max_examples=60, deadline=None)
@given(x=tensors(), bits=st.sampled_from([2, 4]), group_size=st.sampled_from([1, 3, 16, 32, 64]))
def test_kivi_values_per_token_error_is_at_most_half_a_step(x, bits, group_size):
    q = quantize_kivi_values(x, bits, group_size)
    *lead, t, d = x.shape
    assert q.scale.shape == (*lead, t, -(-d // min(group_size, d)), 1)
    assert_int_bounds(x, q)


@settings(max_examples=60, deadline=None)
@given(x=tensors())
def test_int8_per_token_asymmetric_error_is_at_most_half_a_step(x):
    q = quantize_int8(x)
    assert q.scale.shape == (*x.shape[:-1], 1, 1) and q.data.numel() == x.numel()
    assert_int_bounds(x, q)


@settings(max_examples=60, deadline=None)
@given(x=tensors(max_abs=1e30, dtypes=(torch.float32, torch.bfloat16)) | tensors())
def test_fp8_relative_error_is_at_most_2_to_minus_4(x):
    q = quantize_fp8(x)
    xf = x.float()
    scale = q.scale.expand(x.shape)
    assert torch.allclose(q.scale, (xf.abs().amax(-1, keepdim=True) / 448).clamp_min(torch.finfo(torch.float32).tiny))
    err = (dequantize(q, torch.float32) - xf).abs()
    # 3 mantissa bits: half an ulp is 2^-4 of |x|; near 0, half the subnormal step 2^-9 of the scale
    bound = 2.0**-4 * xf.abs() * (1 + 8 * FP32_EPS) + 2.0**-10 * scale
    assert bool((err <= bound).all()), float((err - bound).max())


@pytest.mark.parametrize("quantize", [quantize_fp8, quantize_int8, lambda x: quantize_kivi_keys(x, 4, 32),
                                      lambda x: quantize_kivi_values(x, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zeros_round_trip_exactly_and_dtype_is_kept(quantize, dtype):
    x = torch.zeros(2, 3, 40, 16, dtype=dtype)
    out = dequantize(quantize(x))
    assert out.dtype == dtype and out.shape == x.shape and torch.equal(out, x)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_constant_representable_in_fp16_is_exact(bits):
    x = torch.full((1, 2, 33, 8), -3.25)
    assert torch.equal(dequantize(quantize_groups(x, bits, -2, 32)), x)
    assert torch.equal(dequantize(quantize_groups(x, bits, -1, 8)), x)


def test_per_channel_keys_keep_an_outlier_channel_from_spoiling_the_others():
    x = make_tensor((1, 1, 64, 8), "normal", seed=3, max_abs=6e4)
    x[..., 0] *= 1000.0
    per_channel = (dequantize(quantize_kivi_keys(x, 4, 64)) - x).abs()[..., 1:].max()
    per_token = (dequantize(quantize_kivi_values(x, 4, 8)) - x).abs()[..., 1:].max()
    quiet_range = float(x[..., 1:].amax() - x[..., 1:].amin())
    assert float(per_channel) <= quiet_range / 15 / 2 * 1.01
    assert float(per_token) > 10 * float(per_channel)  # per token, each token's step is set by the outlier


def test_padding_and_short_groups():
    x = make_tensor((2, 3, 70, 20), "normal", seed=0, max_abs=6e4)
    keys = quantize_kivi_keys(x, 4, 32)  # 70 tokens -> 3 groups of 32, the last padded by repeating token 69
    assert (keys.group, keys.scale.shape, keys.data.numel()) == (32, (2, 3, 3, 1, 20), 2 * 3 * 96 * 20 // 2)
    short = quantize_kivi_keys(x[..., :5, :], 2, 32)  # fewer tokens than a group: one group of 5
    assert (short.group, short.scale.shape, short.data.numel()) == (5, (2, 3, 1, 1, 20), 2 * 3 * 5 * 20 // 4)
    values = quantize_kivi_values(x, 2, 16)  # 20 channels -> 2 groups of 16
    assert (values.group, values.scale.shape, values.data.numel()) == (16, (2, 3, 70, 2, 1), 2 * 3 * 70 * 32 // 4)
    assert values.nbytes == values.data.numel() + 4 * 2 * 3 * 70 * 2
    assert dequantize(values).shape == x.shape


def test_bit_packing_is_low_bits_first_and_round_trips():
    assert pack_bits(torch.tensor([1, 2, 3, 4], dtype=torch.uint8), 4).tolist() == [0x21, 0x43]
    assert pack_bits(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4, 3]
    for bits, n in ((4, 101), (2, 103)):
        codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
        assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, n), codes)


@pytest.mark.parametrize("bad, word", [(math.nan, "NaN"), (math.inf, "inf"), (-math.inf, "inf")])
@pytest.mark.parametrize("quantize", [quantize_fp8, quantize_int8, lambda x: quantize_kivi_keys(x, 4, 32),
                                      lambda x: quantize_kivi_values(x, 2, 16)])
def test_nan_and_inf_are_rejected_by_name(quantize, bad, word):
    x = torch.randn(1, 2, 8, 8)
    x[0, 1, 3, 5] = bad
    with pytest.raises(ValueError, match=word):
        quantize(x)


def test_int_range_limited_by_fp16_scales_and_empty_rejected():
    with pytest.raises(ValueError, match="65504"):
        quantize_int8(torch.tensor([[1.0, 7e4]]))
    with pytest.raises(ValueError, match="empty"):
        quantize_int8(torch.zeros(1, 0, 8))
    with pytest.raises(ValueError, match="bits"):
        quantize_groups(torch.ones(2, 2), 3, -1, 2)
    big = torch.tensor([[-65504.0, 65504.0, 65000.0, 1.0]], dtype=torch.float16)
    assert torch.isfinite(dequantize(quantize_int8(big))).all()  # x̂ can overshoot 65504 by s/2: clamped


def test_quantizer_for_resident_caches():
    keys, values = make_tensor((1, 3, 128, 64), "outliers", 1, 6e4), make_tensor((1, 3, 128, 64), "normal", 2, 6e4)
    int4 = quant.quantizer("int4")
    qk, qv = int4.quantize_keys(keys), int4.quantize_values(values)
    assert (qk.dim, qk.group, qv.dim, qv.group) == (-2, 64, -1, 64)
    assert int4.nbytes(qk) == 3 * 128 * 64 // 2 + 4 * 3 * 2 * 64
    assert torch.equal(int4.dequantize(qv, torch.float32), dequantize(quantize_kivi_values(values, 4, 64)))
    assert isinstance(quant.quantizer("fp8").quantize_keys(keys), quant.Fp8Tensor)
    assert quant.quantizer("int8").quantize_keys(keys).dim == -1
    with pytest.raises(ValueError, match="int3"):
        quant.quantizer("int3")
