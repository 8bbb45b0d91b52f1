"""The fp8 scheme: e4m3 codes with one fp32 scale per token per head (`quant.quantize_fp8`).

Payload: scales fp32 [L, 2, H, T, 1] | codes e4m3 [L, 2, H, T, D]. 1 + 4/D bytes per element.
"""

from __future__ import annotations

import math

import torch

from kvtier.codecs import quant
from kvtier.codecs.codec import frombuffer, take
from kvtier.codecs.header import Header


class Fp8Scheme:
    name = "fp8"
    lossless = False
    group_tokens = 0
    group_size = 0
    layer_major = False

    def payload_bytes(self, shape: tuple[int, ...], dtype: str) -> int:
        return math.prod(shape) + 4 * math.prod(shape[:-1])

    def encode_parts(self, kv: torch.Tensor) -> list[torch.Tensor]:
        q = quant.quantize_fp8(kv)
        return [q.scale.cpu().contiguous(), q.data.cpu().contiguous()]

    def decode_payload(self, hdr: Header, payload: memoryview | bytes, device) -> torch.Tensor:
        data = frombuffer(payload)
        scale_bytes = 4 * math.prod(hdr.shape[:-1])
        scale = take(data, 0, scale_bytes, torch.float32, (*hdr.shape[:-1], 1))
        codes = take(data, scale_bytes, math.prod(hdr.shape), torch.float8_e4m3fn, hdr.shape)
        q = quant.Fp8Tensor(codes.to(device), scale.to(device), getattr(torch, hdr.dtype))
        return quant.dequantize(q)
