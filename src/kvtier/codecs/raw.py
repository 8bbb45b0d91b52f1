"""The raw codec: the model's own dtype, bit-exact."""

from __future__ import annotations

import warnings

import torch

from kvtier.blocks import KVLayout
from kvtier.codecs import header

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class RawCodec:
    name = "raw"
    lossless = True

    def encode(self, kv: torch.Tensor) -> bytes:
        """kv: [L, 2, H, T, D] in fp32/fp16/bf16 -> header + the tensor's bytes."""
        dtype = str(kv.dtype).removeprefix("torch.")
        if dtype not in _DTYPE_BYTES or kv.dim() != 5:
            raise ValueError(f"raw codec takes a 5-d fp32/fp16/bf16 tensor [L, 2, H, T, D], got {kv.dtype} {tuple(kv.shape)}")
        # bf16 has no numpy dtype: reinterpret the bits as int16 to get at the bytes
        flat = kv.detach().cpu().contiguous().view(torch.uint8).numpy()
        payload = memoryview(flat).cast("B")
        return header.pack(self.name, dtype, tuple(kv.shape), payload) + payload.tobytes()

    def decode(self, buf: bytes | memoryview, device: torch.device | str | None = None) -> torch.Tensor:
        hdr = header.verify(buf)
        if hdr.codec != self.name:
            raise header.CorruptBlockError(f"foreign block: codec {hdr.codec!r}, expected {self.name!r}")
        payload = memoryview(buf)[header.HEADER_BYTES:]
        if payload.readonly:
            # Zero-copy view of an immutable buffer (the tensor keeps it alive). Callers copy out of
            # it (TieredCache writes it into its layer buffers) and must not write into it.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(payload, dtype=torch.uint8)
        else:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # the caller may reuse its buffer
        kv = data.view(getattr(torch, hdr.dtype)).view(hdr.shape)
        return kv.to(device) if device is not None else kv

    def max_encoded_bytes(self, layout: KVLayout) -> int:
        return header.HEADER_BYTES + layout.block_bytes

    def bytes_per_token(self, layout: KVLayout) -> float:
        return layout.bytes_per_token
