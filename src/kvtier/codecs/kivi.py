"""Asymmetric integer schemes: int8 (per token) and KIVI int4/int2 (keys per channel, values per token).

Payload of a block kv [L, 2, H, T, D], fp16 parts first:
    K scale | K min | V scale | V min (fp16) | K codes | V codes (uint8, bit-packed below 8 bits)
K = kv[:, 0] and V = kv[:, 1], each [L, H, T, D], quantized by `quant.quantize_groups`:
    int8: K and V per token (groups of D channels);
    int4/int2: K per channel over groups of `group_tokens` tokens, V per token over groups of
    `group_size` channels (KIVI). The group lengths are recorded in the header.
"""

from __future__ import annotations

import math

import torch

from kvtier.codecs import quant
from kvtier.codecs.codec import frombuffer, take
from kvtier.codecs.header import Header
from kvtier.codecs.quant import DEFAULT_GROUP_SIZE, DEFAULT_GROUP_TOKENS


class IntScheme:
    lossless = False
    layer_major = False  # scales first, then codes

    def __init__(self, bits: int, group_tokens: int = DEFAULT_GROUP_TOKENS, group_size: int = DEFAULT_GROUP_SIZE):
        assert bits in quant.INT_BITS, bits
        self.bits = bits
        self.name = f"int{bits}"
        # int8 is per token over all channels: no groups to record
        self.group_tokens = 0 if bits == 8 else group_tokens
        self.group_size = 0 if bits == 8 else group_size

    def _groups(self, half_shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """(dim, group) for K and for V."""
        if self.bits == 8:
            return [(-1, half_shape[-1]), (-1, half_shape[-1])]
        return [(-2, self.group_tokens), (-1, self.group_size)]

    def _part_sizes(self, half_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
        """(scale shape, code bytes) for K and for V."""
        sizes = []
        for dim, group in self._groups(half_shape):
            _, grouped, _ = quant.group_layout(half_shape, dim, group)
            sizes.append((quant.scale_shape(grouped, dim), quant.packed_bytes(math.prod(grouped), self.bits)))
        return sizes

    def payload_bytes(self, shape: tuple[int, ...], dtype: str) -> int:
        half = (shape[0], *shape[2:])
        return sum(4 * math.prod(s) + code_bytes for s, code_bytes in self._part_sizes(half))

    def encode_parts(self, kv: torch.Tensor) -> list[torch.Tensor]:
        qs = [quant.quantize_groups(kv[:, i], self.bits, dim, group)
              for i, (dim, group) in enumerate(self._groups((kv.shape[0], *kv.shape[2:])))]
        parts = [t for q in qs for t in (q.scale, q.zero)] + [q.data for q in qs]
        return [t.cpu().contiguous() for t in parts]

    def decode_payload(self, hdr: Header, payload: memoryview | bytes, device) -> torch.Tensor:
        half = (hdr.shape[0], *hdr.shape[2:])
        data, offset, scales = frombuffer(payload), 0, []
        sizes = self._part_sizes(half)
        for shape, _ in sizes:
            n = 2 * math.prod(shape)
            scales.append((take(data, offset, n, torch.float16, shape), take(data, offset + n, n, torch.float16, shape)))
            offset += 2 * n
        dtype, halves = getattr(torch, hdr.dtype), []
        for (dim, group), (scale, zero), (_, code_bytes) in zip(self._groups(half), scales, sizes):
            codes = data[offset:offset + code_bytes]
            offset += code_bytes
            g = quant.group_layout(half, dim, group)[2]
            q = quant.QuantizedTensor(codes.to(device), scale.to(device), zero.to(device), self.bits, dim, g, half, dtype)
            halves.append(quant.dequantize(q))
        return torch.stack(halves, dim=1)
