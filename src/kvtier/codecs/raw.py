"""The raw scheme: the model's own dtype, bit-exact."""

from __future__ import annotations

import math

import torch

from kvtier.codecs.codec import frombuffer
from kvtier.codecs.header import Header

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


class RawScheme:
    name = "raw"
    lossless = True
    group_tokens = 0
    group_size = 0
    layer_major = True  # [L, 2, H, T, D] as is: layer l is the l-th of L equal slices

    def payload_bytes(self, shape: tuple[int, ...], dtype: str) -> int:
        return math.prod(shape) * _DTYPE_BYTES[dtype]

    def encode_parts(self, kv: torch.Tensor) -> list[torch.Tensor]:
        return [kv.cpu().contiguous()]

    def decode_payload(self, hdr: Header, payload: memoryview | bytes, device) -> torch.Tensor:
        if memoryview(payload).readonly:
            # Zero-copy view of an immutable buffer (the tensor keeps it alive). Callers copy out of
            # it (TieredCache writes it into its layer buffers) and must not write into it.
            data = frombuffer(payload)
        else:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # the caller may reuse its buffer
        kv = data.view(getattr(torch, hdr.dtype)).view(hdr.shape)
        return kv.to(device) if device is not None else kv
