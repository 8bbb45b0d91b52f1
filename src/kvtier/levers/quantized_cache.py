"""Resident KV quantization: a transformers Cache whose layers keep KV quantized (KIVI-style).

Each layer holds quantized blocks of `residual_tokens` tokens plus a full-precision residual of the
most recent tokens (< residual_tokens): a block is quantized only once it is full, so keys can be
quantized per channel over the block's tokens (KIVI) and values per token. Every `update` returns
dequantized blocks + the exact residual + the new tokens.

The quantizers are `kvtier.codecs.quant`'s (fp8 e4m3, int8, KIVI int4/int2); the per-block logic
is in `quantize_block` / `dequantize_block`, which take tensors, so `hf.TieredCache` can use the
same resident format. A `Quantizer` can be injected (tests, other schemes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvtier.errors import UserError

CODECS = ("fp8", "int8", "int4", "int2")
DEFAULT_RESIDUAL_TOKENS = 128


class Quantizer(Protocol):
    def quantize_keys(self, keys: torch.Tensor) -> Any: ...
    def quantize_values(self, values: torch.Tensor) -> Any: ...
    def dequantize(self, packed: Any, dtype: torch.dtype) -> torch.Tensor: ...
    def nbytes(self, packed: Any) -> int: ...


@dataclass(slots=True)
class QuantizedBlock:
    """`num_tokens` tokens of one layer's K and V, quantized. keys/values: the quantizer's packing."""

    keys: Any
    values: Any
    num_tokens: int


def check_finite(tensor: torch.Tensor, what: str) -> None:
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError(f"cannot quantize {what}: it holds NaN or inf")


def quantize_block(keys: torch.Tensor, values: torch.Tensor, quantizer: Quantizer) -> QuantizedBlock:
    """keys/values: [B, H, T, D] -> one block (keys per channel over the T tokens, values per token)."""
    check_finite(keys, "keys")
    check_finite(values, "values")
    return QuantizedBlock(quantizer.quantize_keys(keys), quantizer.quantize_values(values), keys.shape[-2])


def dequantize_block(block: QuantizedBlock, quantizer: Quantizer, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return quantizer.dequantize(block.keys, dtype), quantizer.dequantize(block.values, dtype)


def codec_quantizer(codec: str) -> Quantizer:
    """The `kvtier.codecs.quant` quantizer for `codec` (fp8, int8, int4, int2)."""
    if codec not in CODECS:
        raise UserError(f"unknown resident KV codec {codec!r}: use {', '.join(CODECS)}")
    try:
        from kvtier.codecs import quant
    except ImportError as exc:
        raise RuntimeError("kvtier.codecs.quant (the quantizers) is not in this checkout yet") from exc
    return quant.quantizer(codec)


class QuantizedKVLayer(DynamicLayer):
    """keys/values: the full-precision residual [B, H, r, D], r < residual_tokens; `blocks`: the rest."""

    is_croppable = False

    def __init__(self, quantizer: Quantizer, residual_tokens: int = DEFAULT_RESIDUAL_TOKENS) -> None:
        super().__init__()
        self.quantizer = quantizer
        self.residual_tokens = residual_tokens
        self.blocks: list[QuantizedBlock] = []

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys, self.values = key_states[..., :0, :], value_states[..., :0, :]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        residual_keys = torch.cat([self.keys, key_states], dim=-2)
        residual_values = torch.cat([self.values, value_states], dim=-2)
        # quantize before touching any state: a rejected update (NaN/inf) leaves the layer as it was
        new_blocks, num_flushed = self._full_blocks(residual_keys, residual_values)
        old = [dequantize_block(b, self.quantizer, self.dtype) for b in self.blocks]
        # this pass attends to the old blocks dequantized + every token since exactly (KIVI)
        keys = torch.cat([k for k, _ in old] + [residual_keys], dim=-2)
        values = torch.cat([v for _, v in old] + [residual_values], dim=-2)
        self.blocks += new_blocks
        self.keys, self.values = residual_keys[..., num_flushed:, :], residual_values[..., num_flushed:, :]
        return keys, values

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append KV [B, H, n, D] (e.g. a prefix loaded from the tiers) without an attention pass."""
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        residual_keys = torch.cat([self.keys, keys], dim=-2)
        residual_values = torch.cat([self.values, values], dim=-2)
        new_blocks, num_flushed = self._full_blocks(residual_keys, residual_values)
        self.blocks += new_blocks
        self.keys, self.values = residual_keys[..., num_flushed:, :], residual_values[..., num_flushed:, :]

    def token_range(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, end - start, D] of those tokens as attention sees them (quantized blocks
        dequantized, the residual exact)."""
        r = self.residual_tokens
        first, last = start // r, min(-(-end // r), len(self.blocks))
        parts = [dequantize_block(self.blocks[i], self.quantizer, self.dtype) for i in range(first, last)]
        keys = torch.cat([k for k, _ in parts] + [self.keys], dim=-2)
        values = torch.cat([v for _, v in parts] + [self.values], dim=-2)
        offset = start - first * r
        return keys[..., offset:offset + end - start, :], values[..., offset:offset + end - start, :]

    def _full_blocks(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[list[QuantizedBlock], int]:
        r = self.residual_tokens
        num_flushed = keys.shape[-2] // r * r
        blocks = [quantize_block(keys[..., i:i + r, :], values[..., i:i + r, :], self.quantizer)
                  for i in range(0, num_flushed, r)]
        return blocks, num_flushed

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return sum(b.num_tokens for b in self.blocks) + self.keys.shape[-2]

    def reset(self) -> None:
        super().reset()
        self.blocks = []

    def nbytes(self, full_precision_bytes_per_element: int | None = None) -> int:
        """Quantized payload + scales as stored, plus the residual (at its dtype, or as given)."""
        if not self.is_initialized:
            return 0
        per_element = full_precision_bytes_per_element or self.keys.element_size()
        packed = sum(self.quantizer.nbytes(b.keys) + self.quantizer.nbytes(b.values) for b in self.blocks)
        return packed + (self.keys.numel() + self.values.numel()) * per_element


class QuantizedKVCache(Cache):
    """A transformers Cache with quantized resident KV (fp8, int8, int4, int2) and a residual window."""

    def __init__(self, config, codec: str, *, residual_tokens: int = DEFAULT_RESIDUAL_TOKENS,
                 quantizer: Quantizer | None = None) -> None:
        text_config = config.get_text_config(decoder=True)
        self.codec = codec
        quantizer = quantizer or codec_quantizer(codec)
        super().__init__(layers=[QuantizedKVLayer(quantizer, residual_tokens)
                                 for _ in range(text_config.num_hidden_layers)])

    def nbytes(self, full_precision_bytes_per_element: int | None = None) -> int:
        return sum(layer.nbytes(full_precision_bytes_per_element) for layer in self.layers)
