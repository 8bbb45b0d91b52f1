"""Model and accelerator specs, and how a model's KV cache grows with context."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvtier.errors import UserError

# Bytes per KV element, quantization metadata included:
#   fp8  (e4m3): 1 byte + one fp32 scale per (layer, K/V) tensor: negligible, counted as 0.
#   int8: 1 byte + an fp16 scale and zero per token per head (head_dim elements): 1 + 4/head_dim.
#   int4: 0.5 byte + an fp16 scale and zero per group of 32 elements (KIVI-style): 0.5 + 4/32.
_KV_BASE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
KV_DTYPES = tuple(_KV_BASE_BYTES)
# Weights: int4 counts fp16 scales per group of 128 (GPTQ/AWQ-style): 0.5 + 2/128.
WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5 + 2 / 128}


_KV_DTYPE_NOTES = {
    "fp32": "fp32, 4 B/element", "bf16": "bf16, 2 B/element", "fp16": "fp16, 2 B/element",
    "fp8": "fp8 e4m3, 1 B/element (one fp32 scale per layer tensor, not counted)",
    "int8": "int8, 1 B/element + fp16 scale and zero per token per head (4/head_dim B)",
    "int4": "int4, 0.5 B/element + fp16 scale and zero per 32-element group (0.125 B)",
}


def kv_dtype_note(kv_dtype: str) -> str:
    """How a KV precision is charged, scale overhead included (printed with every plan)."""
    kv_element_bytes(kv_dtype, 1)  # validates
    return _KV_DTYPE_NOTES[kv_dtype]


def kv_element_bytes(kv_dtype: str, head_dim: int) -> float:
    if kv_dtype not in _KV_BASE_BYTES:
        raise UserError(f"unknown KV dtype {kv_dtype!r}: use one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "int8":
        return 1.0 + 4.0 / head_dim
    if kv_dtype == "int4":
        return 0.5 + 4.0 / 32
    return _KV_BASE_BYTES[kv_dtype]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What sizing needs of a model. MLA models set `mla_kv_lora_rank` (and no per-head KV)."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    params_total: float
    params_active: float
    max_context: int
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    mla_kv_lora_rank: int = 0
    mla_rope_dim: int = 0

    @property
    def is_mla(self) -> bool:
        return self.mla_kv_lora_rank > 0

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs per token, 2 x active params (the attention term is left out)."""
        return 2.0 * self.params_active

    def kv_heads_per_rank(self, tp: int = 1) -> int:
        """KV heads shard across TP ranks; with tp > n_kv_heads each rank holds one (replicated)."""
        return max(1, math.ceil(self.num_kv_heads / tp))

    def cached_tokens(self, context: int, sliding: bool) -> int:
        """Tokens a layer holds at `context`. A sliding layer keeps window - 1 tokens between steps
        (transformers' DynamicSlidingWindowLayer: the next query attends to them plus itself)."""
        if sliding and self.sliding_window:
            return min(context, self.sliding_window - 1)
        return context

    def kv_bytes(self, context: int, kv_dtype: str = "bf16", tp: int = 1) -> float:
        """KV bytes of ONE sequence of `context` tokens on ONE tensor-parallel rank."""
        if self.is_mla:
            # One compressed latent (kv_lora_rank) + the shared rope key per token per layer,
            # not per head and no x2 for K and V; every TP rank holds all of it.
            per_token_layer = (self.mla_kv_lora_rank + self.mla_rope_dim) * kv_element_bytes(kv_dtype, self.mla_kv_lora_rank + self.mla_rope_dim)
            return self.num_layers * per_token_layer * context
        per_token_layer = 2 * self.kv_heads_per_rank(tp) * self.head_dim * kv_element_bytes(kv_dtype, self.head_dim)
        full_layers = self.num_layers - self.num_sliding_layers
        return per_token_layer * (full_layers * self.cached_tokens(context, False)
                                  + self.num_sliding_layers * self.cached_tokens(context, True))

    def kv_bytes_per_token(self, kv_dtype: str = "bf16", tp: int = 1, context: int | None = None) -> float:
        """Per-token KV bytes on one rank; with sliding layers, the average at `context`."""
        if context is None:
            context = self.max_context
        return self.kv_bytes(context, kv_dtype, tp) / context

    def weights_bytes(self, dtype: str = "bf16") -> float:
        """All parameters (MoE: every expert) at `dtype`."""
        if dtype not in WEIGHT_BYTES:
            raise UserError(f"unknown weight dtype {dtype!r}: use one of {', '.join(WEIGHT_BYTES)}")
        return self.params_total * WEIGHT_BYTES[dtype]


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    hbm_bytes: int
    hbm_bandwidth_bytes_s: float
    bf16_flops: float  # dense
    tdp_watts: float
