"""`Codec`: a payload scheme (raw, fp8, int8, KIVI) framed by the checksummed header, optionally zstd'd.

A scheme turns kv [L, 2, H, T, D] into a few contiguous CPU tensors (the payload parts, fp16/fp32
parts first so every part starts aligned to its element size) and back. The codec owns everything
around it: input checks, the header, zstd, verification and the foreign-block check. A scheme whose
payload is layer-major with one size per layer (`layer_major`: raw) is written as a layered block (a
checksum per layer, `codecs/header.py`) unless zstd'd, so a reader may take one layer of it at a time
(`decode_layer`).
"""

from __future__ import annotations

import warnings
from typing import Protocol

import torch
import xxhash

from kvtier.blocks import KVLayout
from kvtier.codecs import header, zstd
from kvtier.codecs.header import HEADER_BYTES, CorruptBlockError, Header


class Scheme(Protocol):
    name: str                # "raw", "fp8", "int8", "int4", "int2"
    lossless: bool
    group_tokens: int        # recorded in the header (0 where unused)
    group_size: int
    layer_major: bool        # the payload is L equal slices, layer by layer (a checksum per layer)

    def payload_bytes(self, shape: tuple[int, ...], dtype: str) -> int: ...
    def encode_parts(self, kv: torch.Tensor) -> list[torch.Tensor]: ...
    def decode_payload(self, hdr: Header, payload: memoryview | bytes, device) -> torch.Tensor: ...


class Codec:
    """encode(kv [L, 2, H, T, D], key) -> header + payload bytes bound to `key`; decode(buf, key) -> kv,
    verified first (`decode_verified` for a block the tier manager has already verified)."""

    def __init__(self, scheme: Scheme, use_zstd: bool = False) -> None:
        self.scheme = scheme
        self.use_zstd = use_zstd
        self.name = scheme.name + (header.ZSTD_SUFFIX if use_zstd else "")
        self.lossless = scheme.lossless
        self.layered = scheme.layer_major and not use_zstd

    def __repr__(self) -> str:
        return f"Codec({self.name!r})"

    def encode(self, kv: torch.Tensor, key: bytes) -> bytes:
        dtype = _check_kv(kv)
        if (kv.shape[1] != 2 or dtype.startswith("float8")) and self.scheme.name != "raw":
            raise ValueError(f"codec {self.name!r} quantizes K and V of a float KV; {dtype} {tuple(kv.shape)} "
                             "(fp8 KV, an MLA latent) is stored raw only")
        parts = [_byte_view(p) for p in self.scheme.encode_parts(kv.detach())]
        flags = 0
        if self.use_zstd:
            plain = b"".join(parts)
            packed = zstd.compress(plain)
            flags = header.FLAG_ZSTD
            if len(packed) >= len(plain):  # incompressible: store as is, so max_encoded_bytes holds
                flags |= header.FLAG_STORED
            parts = [plain if flags & header.FLAG_STORED else packed]
        if self.layered:
            (payload,) = parts
            step = len(payload) // kv.shape[0]
            table = header.layer_table(key, [payload[n * step:(n + 1) * step] for n in range(kv.shape[0])])
            hdr = Header(self.name, dtype, tuple(kv.shape), len(payload), header.table_checksum(key, table),
                         header.FLAG_LAYERS, self.scheme.group_tokens, self.scheme.group_size)
            return b"".join((header.pack(hdr, key), payload, table))
        checksum = xxhash.xxh3_64()
        for part in parts:
            checksum.update(part)
        hdr = Header(self.name, dtype, tuple(kv.shape), sum(len(p) for p in parts), checksum.intdigest(),
                     flags, self.scheme.group_tokens, self.scheme.group_size)
        return b"".join((header.pack(hdr, key), *parts))

    def decode(self, buf: bytes | memoryview, key: bytes, device: torch.device | str | None = None) -> torch.Tensor:
        """Verify, then decode. A corrupt, truncated or foreign block (another key's, another codec's)
        raises CorruptBlockError."""
        return self.decode_verified(header.verify(buf, key), buf, device)

    def decode_verified(self, hdr: Header, buf: bytes | memoryview,
                        device: torch.device | str | None = None) -> torch.Tensor:
        """Decode a block whose `header.verify` (checksums, key) already passed and gave `hdr`: each
        payload is checksummed once on its way up. The codec and its parameters are still checked."""
        self._check_params(hdr)
        expected_bytes = self.scheme.payload_bytes(hdr.shape, hdr.dtype)
        payload = memoryview(buf).cast("B")[HEADER_BYTES:HEADER_BYTES + hdr.payload_bytes]
        if hdr.flags & header.FLAG_ZSTD and not hdr.flags & header.FLAG_STORED:
            payload = zstd.decompress(payload, expected_bytes)
        if len(payload) != expected_bytes:
            raise CorruptBlockError(f"payload is {len(payload)} bytes, shape {hdr.shape} needs {expected_bytes}")
        return self.scheme.decode_payload(hdr, payload, device)

    def decode_layer(self, hdr: Header, buf: bytes | memoryview, layer: int,
                     device: torch.device | str | None = None) -> torch.Tensor:
        """Layer `layer` of a layered block ([2, H, T, D]; MLA [1, 1, T, D]) whose header and that layer's
        slice are proven (`header.verify(payload=False)`, `header.check_layer`): a view of `buf` on the CPU."""
        self._check_params(hdr)
        if not hdr.layered or self.scheme.payload_bytes(hdr.shape, hdr.dtype) != hdr.payload_bytes:
            raise CorruptBlockError(f"block of {hdr.payload_bytes} payload bytes, flags {hdr.flags:#x}: not layered")
        start, stop = hdr.layer_range(layer)
        dtype = getattr(torch, hdr.dtype)
        kv = frombuffer(buf, dtype, start, (stop - start) // dtype.itemsize).view(hdr.shape[1:])
        return kv.to(device) if device is not None else kv

    def _check_params(self, hdr: Header) -> None:
        params = (self.scheme.group_tokens, self.scheme.group_size)
        if hdr.codec != self.name or (hdr.group_tokens, hdr.group_size) != params:
            raise CorruptBlockError(f"foreign block: codec {hdr.codec!r} groups {hdr.group_tokens}/{hdr.group_size}, "
                                    f"expected {self.name!r} groups {params[0]}/{params[1]}")

    def max_encoded_bytes(self, layout: KVLayout) -> int:
        """Exact for codecs without zstd (a layered block's table included); an upper bound with it
        (incompressible payloads are stored)."""
        table = header.table_bytes(layout.num_layers) if self.layered else 0
        return HEADER_BYTES + self.scheme.payload_bytes(layout.block_shape, layout.dtype) + table

    def bytes_per_token(self, layout: KVLayout) -> float:
        """Payload bytes (codes + scales, no header, before zstd) per token of a full block."""
        return self.scheme.payload_bytes(layout.block_shape, layout.dtype) / layout.block_tokens


def _check_kv(kv: torch.Tensor) -> str:
    dtype = str(kv.dtype).removeprefix("torch.")
    if dtype not in header.DTYPE_IDS or kv.dim() != 5 or kv.shape[1] not in (1, 2) or kv.numel() == 0:
        raise ValueError(f"codecs take a non-empty fp32/fp16/bf16/fp64/fp8 tensor [L, 2, H, T, D] "
                         f"(an MLA latent: [L, 1, 1, T, D]), "
                         f"got {kv.dtype} {tuple(kv.shape)}")
    return dtype


def byte_array(tensor: torch.Tensor):
    """A numpy uint8 view of a CPU tensor whose last dim is contiguous (any dtype, bf16/fp8 included):
    what a plain single-threaded memcpy of KV copies between."""
    return tensor.view(torch.uint8).numpy()


def _byte_view(part: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16/fp8 included)."""
    assert part.device.type == "cpu" and part.is_contiguous(), (part.device, part.stride())
    return memoryview(byte_array(part)).cast("B")


# torch warns at every tensor over a read-only buffer (a lease, bytes); decoders only read theirs. Filtered for
# this module's calls once, here (a `catch_warnings` per call cost more than a layer slice's copy).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


def frombuffer(payload: memoryview | bytes, dtype: torch.dtype = torch.uint8, offset: int = 0,
               count: int = -1) -> torch.Tensor:
    """A tensor over the payload's bytes without a copy (`count` elements of `dtype` from byte `offset`;
    read-only buffers too: decoders only read it)."""
    return torch.frombuffer(payload, dtype=dtype, count=count, offset=offset)


def take(data: torch.Tensor, offset: int, num_bytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A typed view of data[offset:offset + num_bytes] (offset aligned to the dtype by the part order)."""
    return data[offset:offset + num_bytes].view(dtype).view(shape)
