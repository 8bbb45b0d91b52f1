"""The block header: every stored block is self-describing and checksummed.

Layout (little-endian, 64 bytes, so the payload starts 64-byte aligned within the block):
    magic "KVTB" | version u16 | codec id u16 | flags u16 | dtype id u16 | group_tokens u16 |
    group_size u16 | shape 5 x u32 ([L, 2, H, T, D], MLA [L, 1, 1, T, D]; T = the block's real token count, before any
    padding to a quantization group) | key tag u32 | payload length u64 | payload xxh3_64 u64 |
    header xxh3_64 u64 (over the block's key, then all the fields before it)
flags: bit 0 = the payload went through zstd ("+zstd" codecs), bit 1 = zstd did not shrink it and it
is stored as is, bit 2 = a layer table trails the payload (`FLAG_LAYERS`). The payload checksum covers the
payload as stored (compressed, for zstd).

Layered blocks (version 4; a codec whose payload is layer-major with one size per layer: raw, not zstd):
    header | payload (L slices of payload_bytes / L) | layer table: L x u64, the xxh3_64 of each slice seeded
    with the block's key and the layer (`layer_seed`)
and the payload checksum is the key-seeded xxh3_64 of the table. So one layer's slice is proven on its own
(`check_layer`, after `verify(payload=False)` proved the header and the table): a reader may read and hand
out layer l of a block before the rest of it is read. The whole payload proof checks every slice.
Version 3 blocks (no flag 2; the format before, files on disk from before) are read as they always were.

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
VERSION = 4  # 4: the layer table (flag 2); 3: blocks bound to their keys (2 had a reserved field there)
READ_VERSIONS = (3, 4)  # 3 is read as before (no layer table); older ones are rejected: misses, recomputed
_FIELDS = struct.Struct("<4sHHHHHH5IIQQ")
_CHECK = struct.Struct("<Q")
HEADER_BYTES = _FIELDS.size + _CHECK.size
assert HEADER_BYTES == 64, HEADER_BYTES

CODEC_IDS = {"raw": 1, "fp8": 2, "int8": 3, "int4": 4, "int2": 5}
# float64: tests on tiny models; float8: vLLM's fp8 KV cache, stored as is (raw only)
DTYPE_IDS = {"float32": 1, "float16": 2, "bfloat16": 3, "float64": 4, "float8_e4m3fn": 5, "float8_e5m2": 6}
FLAG_ZSTD = 1
FLAG_STORED = 2
FLAG_LAYERS = 4
_LAYER_SUM = struct.Struct("<Q")
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
    layer_sums: tuple[int, ...] = ()  # layered blocks (FLAG_LAYERS): each layer's slice checksum

    @property
    def num_tokens(self) -> int:
        return self.shape[3]

    @property
    def layered(self) -> bool:
        return bool(self.flags & FLAG_LAYERS)

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's slice of a layered block's payload."""
        return self.payload_bytes // self.shape[0]

    def layer_range(self, layer: int) -> tuple[int, int]:
        """Where layer `layer`'s slice is in the block: [start, stop) bytes from its first byte."""
        start = HEADER_BYTES + layer * self.layer_bytes
        return start, start + self.layer_bytes


def _key_tag(key: bytes) -> int:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a block key is {KEY_BYTES} bytes, got {len(key)}")
    return int.from_bytes(key[:4], "little")


def _header_checksum(key: bytes, fields: bytes | memoryview) -> int:
    h = xxhash.xxh3_64(key)
    h.update(fields)
    return h.intdigest()


def layer_seed(key: bytes, layer: int) -> int:
    """The xxh3 seed of layer `layer`'s slice checksum in the block `key` names."""
    return xxhash.xxh3_64_intdigest(key + struct.pack("<I", layer))


def layer_table(key: bytes, slices: list[bytes | memoryview]) -> bytes:
    """The layer table of a layered block: each slice's checksum, seeded with the key and the layer."""
    return b"".join(_LAYER_SUM.pack(xxhash.xxh3_64_intdigest(s, seed=layer_seed(key, n)))
                    for n, s in enumerate(slices))


def table_checksum(key: bytes, table: bytes | memoryview) -> int:
    """A layered block's payload checksum: its layer table's, seeded with the key."""
    h = xxhash.xxh3_64(key)
    h.update(table)
    return h.intdigest()


def table_bytes(num_layers: int) -> int:
    return num_layers * _LAYER_SUM.size


def peek_layers(buf: bytes | memoryview) -> tuple[int, int] | None:
    """(payload bytes, layers) of an *unverified* header that says a layer table trails its payload; None
    for any other block or bytes. Only for planning a read (`DiskTier.lease_layers`): `verify` decides."""
    view = memoryview(buf).cast("B")
    if len(view) < HEADER_BYTES:
        return None
    magic, version, _, flags, *_, num_layers, _, _, _, _, _, payload_bytes, _ = _FIELDS.unpack(view[:_FIELDS.size])
    if magic != MAGIC or version != VERSION or not flags & FLAG_LAYERS or not num_layers:
        return None
    return payload_bytes, num_layers


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
    if version not in READ_VERSIONS:
        raise CorruptBlockError(f"unsupported block format version {version}")
    key_tag = rest[5]
    if key_tag != _key_tag(key):
        raise ForeignBlockError(f"block was written for another key (tag {key_tag:08x}, "
                                f"expected {_key_tag(key):08x})")
    (header_sum,) = _CHECK.unpack(view[_FIELDS.size:HEADER_BYTES])
    if _header_checksum(key, fields) != header_sum:
        raise CorruptBlockError("header checksum mismatch (corrupt, or written for another key)")
    known = FLAG_ZSTD | FLAG_STORED | (FLAG_LAYERS if version >= 4 else 0)
    if codec_id not in _ID_TO_CODEC or dtype_id not in _ID_TO_DTYPE or flags & ~known:
        raise CorruptBlockError(f"unknown codec id {codec_id}, dtype id {dtype_id} or flags {flags:#x}")
    shape, payload_bytes, payload_sum = tuple(rest[:5]), rest[6], rest[7]
    layered = bool(flags & FLAG_LAYERS)
    if layered and (flags & FLAG_ZSTD or not shape[0] or payload_bytes % shape[0]):
        raise CorruptBlockError(f"a layer table over {payload_bytes} bytes in {shape[0]} layers, flags {flags:#x}")
    trailer = table_bytes(shape[0]) if layered else 0
    if len(view) - HEADER_BYTES - trailer != payload_bytes:
        raise CorruptBlockError(f"payload is {len(view) - HEADER_BYTES - trailer} bytes, header says {payload_bytes}")
    codec = _ID_TO_CODEC[codec_id] + (ZSTD_SUFFIX if flags & FLAG_ZSTD else "")
    sums: tuple[int, ...] = ()
    if layered:
        table = view[HEADER_BYTES + payload_bytes:]
        if table_checksum(key, table) != payload_sum:
            raise CorruptBlockError("layer table checksum mismatch")
        sums = tuple(s for (s,) in _LAYER_SUM.iter_unpack(table))
    hdr = Header(codec, _ID_TO_DTYPE[dtype_id], shape, payload_bytes, payload_sum, flags, group_tokens, group_size,
                 sums)
    if payload and layered:
        for layer in range(shape[0]):
            check_layer(hdr, key, view, layer)
    elif payload and xxhash.xxh3_64_intdigest(view[HEADER_BYTES:]) != payload_sum:
        raise CorruptBlockError("payload checksum mismatch")
    return hdr


def check_layer(hdr: Header, key: bytes, buf: bytes | memoryview, layer: int) -> None:
    """Prove layer `layer`'s slice of a layered block (`buf`: the block's bytes, at least up to that slice's
    end; `hdr`: from `verify(..., payload=False)`, which proved the table); raise CorruptBlockError."""
    start, stop = hdr.layer_range(layer)
    data = memoryview(buf).cast("B")[start:stop]
    if len(data) != stop - start or xxhash.xxh3_64_intdigest(data, seed=layer_seed(key, layer)) != \
            hdr.layer_sums[layer]:
        raise CorruptBlockError(f"layer {layer} checksum mismatch")
