"""The block header: every stored block is self-describing and checksummed.

Layout (little-endian, 64 bytes, so the payload starts 64-byte aligned within the block):
    magic "KVTB" | version u16 | codec id u16 | flags u16 | dtype id u16 | group_tokens u16 |
    group_size u16 | shape 5 x u32 ([L, 2, H, T, D], MLA [L, 1, 1, T, D]; T = the block's real token count, before any
    padding to a quantization group) | key tag u32 | payload length u64 | payload xxh3_64 u64 |
    header xxh3_64 u64 (over the block's key, then all the fields before it)
flags: bit 0 = the payload went through zstd ("+zstd" codecs), bit 1 = zstd did not shrink it and it
is stored as is. The payload checksum covers the payload as stored (compressed, for zstd).

Every block is bound to its key: the header checksum is seeded with the 16-byte block key (which
itself chains the model, layout, codec, tenant and every token id of the prefix), and the key tag
(its first 4 bytes) says early which key a block was written for. A block file copied over another,
two blocks swapped, or a pool value written under another key fails `verify(buf, key)` although the
block is internally intact. A block whose magic, version, codec, key, lengths or checksums disagree
is *corrupt*: it is never decoded into KV; the reader treats it as a miss and recomputes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvtier.blocks import KEY_BYTES

MAGIC = b"KVTB"
VERSION = 3  # 3: blocks bound to their keys (2 had a reserved field there)
_FIELDS = struct.Struct("<4sHHHHHH5IIQQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + _CHECK.size
assert HEADER_BYTES == 64, HEADER_BYTES

CODEC_IDS = {"raw": 1, "fp8": 2, "int8": 3, "int4": 4, "int2": 5}
# float64: tests on tiny models; float8: vLLM's fp8 KV cache, stored as is (raw only)
DTYPE_IDS = {"float32": 1, "float16": 2, "bfloat16": 3, "float64": 4, "float8_e4m3fn": 5, "float8_e5m2": 6}
FLAG_ZSTD = 1
FLAG_STORED = 2
_ID_TO_CODEC = {v: k for k, v in CODEC_IDS.items()}
_ID_TO_DTYPE = {v: k for k, v in DTYPE_IDS.items()}
ZSTD_SUFFIX = "+zstd"


class CorruptBlockError(ValueError):
    """A stored block that fails verification (magic, version, codec, key, length or checksum)."""


class ForeignBlockError(CorruptBlockError):
    """An intact block that is not the one its key names (written for another key)."""


@dataclass(frozen=True, slots=True)
class Header:
    codec: str                      # full codec name, "int4" or "int4+zstd"
    dtype: str                      # the KV dtype the block decodes to
    shape: tuple[int, int, int, int, int]
    payload_bytes: int              # as stored
    payload_checksum: int
    flags: int = 0
    group_tokens: int = 0           # quantization groups (0 where the codec has none)
    group_size: int = 0

    @property
    def num_tokens(self) -> int:
        return self.shape[3]


def _key_tag(key: bytes) -> int:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a block key is {KEY_BYTES} bytes, got {len(key)}")
    return int.from_bytes(key[:4], "little")


def _header_checksum(key: bytes, fields: bytes | memoryview) -> int:
    h = xxhash.xxh3_64(key)
    h.update(fields)
    return h.intdigest()


def pack(header: Header, key: bytes) -> bytes:
    """The 64 header bytes for `header` bound to `key` (payload_bytes/payload_checksum describe the payload)."""
    assert len(header.shape) == 5, header.shape
    base = header.codec.removesuffix(ZSTD_SUFFIX)
    fields = _FIELDS.pack(MAGIC, VERSION, CODEC_IDS[base], header.flags, DTYPE_IDS[header.dtype],
                          header.group_tokens, header.group_size, *header.shape, _key_tag(key),
                          header.payload_bytes, header.payload_checksum)
    return fields + _CHECK.pack(_header_checksum(key, fields))


def verify(buf: bytes | memoryview, key: bytes, *, payload: bool = True) -> Header:
    """Check that `buf` is the intact block stored under `key` (header, key binding and payload
    checksum) without decoding it; raise CorruptBlockError (ForeignBlockError: another key's block).

    `payload=False` checks the key-bound header only (key tag, header checksum, lengths), not the
    payload hash: for a block that never left this process's memory (a DRAM slot it wrote itself),
    as trusted as the device KV it came from. Every block that crossed a process or a medium (`shm:`,
    SSD, pools) is checked with `payload=True`."""
    view = memoryview(buf).cast("B")
    if len(view) < HEADER_BYTES:
        raise CorruptBlockError(f"block truncated: {len(view)} bytes, the header alone is {HEADER_BYTES}")
    fields = view[:_FIELDS.size]
    magic, version, codec_id, flags, dtype_id, group_tokens, group_size, *rest = _FIELDS.unpack(fields)
    if magic != MAGIC:
        raise CorruptBlockError("not a kvtier block (bad magic)")
    if version != VERSION:
        raise CorruptBlockError(f"unsupported block format version {version}")
    key_tag = rest[5]
    if key_tag != _key_tag(key):
        raise ForeignBlockError(f"block was written for another key (tag {key_tag:08x}, "
                                f"expected {_key_tag(key):08x})")
    (header_sum,) = _CHECK.unpack(view[_FIELDS.size:HEADER_BYTES])
    if _header_checksum(key, fields) != header_sum:
        raise CorruptBlockError("header checksum mismatch (corrupt, or written for another key)")
    if codec_id not in _ID_TO_CODEC or dtype_id not in _ID_TO_DTYPE or flags & ~(FLAG_ZSTD | FLAG_STORED):
        raise CorruptBlockError(f"unknown codec id {codec_id}, dtype id {dtype_id} or flags {flags:#x}")
    shape, payload_bytes, payload_sum = tuple(rest[:5]), rest[6], rest[7]
    if len(view) - HEADER_BYTES != payload_bytes:
        raise CorruptBlockError(f"payload is {len(view) - HEADER_BYTES} bytes, header says {payload_bytes}")
    if payload and xxhash.xxh3_64_intdigest(view[HEADER_BYTES:]) != payload_sum:
        raise CorruptBlockError("payload checksum mismatch")
    codec = _ID_TO_CODEC[codec_id] + (ZSTD_SUFFIX if flags & FLAG_ZSTD else "")
    return Header(codec, _ID_TO_DTYPE[dtype_id], shape, payload_bytes, payload_sum, flags, group_tokens, group_size)
