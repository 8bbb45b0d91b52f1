"""Run by `test_vllm_layouts_in_vllm.py` in `.venv-vllm`: kvtier's block views against vLLM 0.32's own code.

Each layer's cache is made by vLLM's `create_kv_cache_views` (every `KVCacheLayout`), K and V are written
by vLLM's own CPU kernel (`cpu_attn_reshape_and_cache`, as `CPUAttentionImpl.do_kv_cache_update` calls
it, fp8 included) or read by the GPU backends' split; prints one JSON line of findings."""

from __future__ import annotations

import json

import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheLayout, KVCacheTensor, MLAAttentionSpec,
                                        create_kv_cache_views)

import kvtier
from kvtier.blocks import KVLayout
from kvtier.integrations.vllm.layouts import block_view, kv_dtype

L, B, H, T, D = 2, 5, 2, 32, 64
# the layouts whose pages are whole (L and B outermost): the ones a KVCacheTensor of layer + block strides describes
BLOCK_COMPACT = [m for m in KVCacheLayout if m.is_block_compact]


def views(spec, layout: KVCacheLayout) -> list[torch.Tensor]:
    page = spec.page_size_bytes
    layer_compact = layout.is_layer_compact
    tensor = KVCacheTensor(size=L * B * page, layers=[f"l{i}" for i in range(L)],
                           layer_stride=B * page if layer_compact else page,
                           block_stride=page if layer_compact else L * page)
    raw = torch.zeros(L * B * page, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, B, layout, tensor)


def cpu_kernel_case(cache_dtype: str) -> dict:
    """vLLM's CPU kernel writes tokens' K and V; kvtier's view must find them at [block, 0|1, head, slot]."""
    torch_dtype = torch.uint8 if cache_dtype != "auto" else torch.float32
    spec = FullAttentionSpec(block_size=T, num_kv_heads=H, head_size=D, dtype=torch_dtype)
    (cache, *_) = views(spec, KVCacheLayout.LBHNC)
    layout = KVLayout(L, H, D, dtype=kv_dtype(cache_dtype, "float32"), block_tokens=T)
    view = block_view(cache, "planes", layout)
    num_tokens = 40
    key, value = torch.randn(num_tokens, H, D), torch.randn(num_tokens, H, D)
    slots = torch.tensor([3 * T + i for i in range(T)] + [1 * T + i for i in range(num_tokens - T)])
    key_cache, value_cache = cache.view(B, H, 2 * T, D).chunk(2, dim=2)
    isa = _get_attn_isa(torch.float32, T, D, cache_dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, kv_cache_dtype=cache_dtype)
    k_t = view[:, 0].reshape(B, H, D, T).transpose(-1, -2)  # the vec kernels keep K transposed: [H, D, T]
    got_k = torch.stack([k_t[s // T, :, s % T] for s in slots.tolist()]).float()
    got_v = torch.stack([view[s // T, 1, :, s % T] for s in slots.tolist()]).float()
    floor = key.abs().clamp_min(2 ** -6)  # relative error (fp8: within a step of its mantissa)
    return {"isa": isa, "view_dtype": str(view.dtype),
            "rel_err_k_transposed": float(((got_k - key).abs() / floor).max()),
            "rel_err_v": float(((got_v - value).abs() / value.abs().clamp_min(2 ** -6)).max()),
            "untouched_zero": bool((view[0].float() == 0).all() and (view[2].float() == 0).all())}


def split_case(layout: KVCacheLayout) -> bool:
    """The GPU backends' own split of a vLLM-made view (FlashAttention / Triton / FlashInfer) vs kvtier's view."""
    spec = FullAttentionSpec(block_size=T, num_kv_heads=H, head_size=D, dtype=torch.float32)
    ok = True
    for i, cache in enumerate(views(spec, layout)):
        cache.copy_(torch.randn(cache.shape))
        key, value = cache.transpose(1, 2).split(D, dim=-1)  # flash_attn.py / triton_attn.py
        view = block_view(cache, "cells", KVLayout(L, H, D, block_tokens=T))
        ok &= torch.equal(view[:, 0], key.transpose(1, 2)) and torch.equal(view[:, 1], value.transpose(1, 2))
    return ok


def mla_case(layout: KVCacheLayout) -> list[int]:
    latent = 576  # DeepSeek: kv_lora_rank 512 + rope 64
    spec = MLAAttentionSpec(block_size=T, num_kv_heads=1, head_size=latent, dtype=torch.bfloat16)
    (cache, *_) = views(spec, layout)
    cache.copy_(torch.randn(cache.shape))
    view = block_view(cache, "latent", KVLayout(L, 1, latent, dtype="bfloat16", block_tokens=T, latent=True))
    assert torch.equal(view[:, 0, 0], cache[:, 0])
    return list(cache.shape)


if __name__ == "__main__":
    print(json.dumps({
        "kvtier": kvtier.__file__,
        "cpu_layouts": [m.name for m in CPUAttentionBackend.supported_kv_cache_layouts()],
        "cpu_auto": cpu_kernel_case("auto"),
        "cpu_fp8": {d: cpu_kernel_case(d) for d in ("fp8", "fp8_e5m2")},
        "split": {m.name: split_case(m) for m in BLOCK_COMPACT},
        "mla_shape": {m.name: mla_case(m) for m in (KVCacheLayout.LBHNC, KVCacheLayout.BLNHC)},
    }))
