"""The block header: every stored block is self-describing and checksummed.

Layout (little-endian, 64 bytes):
    magic "KVTB" | version u16 | codec id u16 | dtype id u16 | reserved u16
    shape 5 x u32 ([L, 2, H, T, D]) | payload length u64 | payload xxh3_64 u64 | header xxh3_64 u64
A block whose magic, version, codec, lengths or checksums disagree is *corrupt*: it is never
decoded into KV; the reader treats it as a miss and recomputes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVTB"
VERSION = 1
_FIELDS = struct.Struct("<4sHHHH5IQQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + _CHECK.size

CODEC_IDS = {"raw": 1, "fp8": 2, "int8": 3, "int4": 4, "int2": 5}
DTYPE_IDS = {"float32": 1, "float16": 2, "bfloat16": 3}
_ID_TO_CODEC = {v: k for k, v in CODEC_IDS.items()}
_ID_TO_DTYPE = {v: k for k, v in DTYPE_IDS.items()}


class CorruptBlockError(ValueError):
    """A stored block that fails verification (magic, version, codec, length or checksum)."""


@dataclass(frozen=True, slots=True)
class Header:
    codec: str
    dtype: str
    shape: tuple[int, int, int, int, int]
    payload_bytes: int
    payload_checksum: int


def pack(codec: str, dtype: str, shape: tuple[int, ...], payload: bytes | memoryview) -> bytes:
    assert len(shape) == 5, shape
    fields = _FIELDS.pack(MAGIC, VERSION, CODEC_IDS[codec], DTYPE_IDS[dtype], 0, *shape, len(payload),
                          xxhash.xxh3_64_intdigest(payload))
    return fields + _CHECK.pack(xxhash.xxh3_64_intdigest(fields))


def verify(buf: bytes | memoryview) -> Header:
    """Check the header and the payload checksum without decoding; raise CorruptBlockError."""
    view = memoryview(buf)
    if len(view) < HEADER_BYTES:
        raise CorruptBlockError(f"block truncated: {len(view)} bytes, the header alone is {HEADER_BYTES}")
    fields = view[:_FIELDS.size]
    magic, version, codec_id, dtype_id, _, *rest = _FIELDS.unpack(fields)
    if magic != MAGIC:
        raise CorruptBlockError("not a kvtier block (bad magic)")
    (header_sum,) = _CHECK.unpack(view[_FIELDS.size:HEADER_BYTES])
    if xxhash.xxh3_64_intdigest(fields) != header_sum:
        raise CorruptBlockError("header checksum mismatch")
    if version != VERSION:
        raise CorruptBlockError(f"unsupported block format version {version}")
    if codec_id not in _ID_TO_CODEC or dtype_id not in _ID_TO_DTYPE:
        raise CorruptBlockError(f"unknown codec id {codec_id} or dtype id {dtype_id}")
    shape, payload_bytes, payload_sum = tuple(rest[:5]), rest[5], rest[6]
    if len(view) - HEADER_BYTES != payload_bytes:
        raise CorruptBlockError(f"payload is {len(view) - HEADER_BYTES} bytes, header says {payload_bytes}")
    if xxhash.xxh3_64_intdigest(view[HEADER_BYTES:]) != payload_sum:
        raise CorruptBlockError("payload checksum mismatch")
    return Header(_ID_TO_CODEC[codec_id], _ID_TO_DTYPE[dtype_id], shape, payload_bytes, payload_sum)
