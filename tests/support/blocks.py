"""Block files as older kvtier versions wrote them: what a reader must still read, or reject as a miss."""

from __future__ import annotations

import torch
import xxhash

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec, header

# Four raw blocks of a tiny layout, each filled with its index: the tests of what moves blocks (the mover, the
# host block pool) put and restore these.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=4)
KEYS = block_keys(KeySpace("fp", LAYOUT, "raw"), list(range(16)))
CODEC = get_codec("raw")
BLOCKS = [torch.full(LAYOUT.block_shape, float(i)) for i in range(4)]
SLOT = CODEC.max_encoded_bytes(LAYOUT)


def v3_block(kv: torch.Tensor, key: bytes, *, version: int = 3) -> bytes:
    """A raw fp32 block as format version 3 wrote it (no layer table; the payload's plain xxh3), or the
    same bytes stamped with another `version` (2: a format no reader takes any more)."""
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    fields = header._FIELDS.pack(header.MAGIC, version, header.CODEC_IDS["raw"], 0, header.DTYPE_IDS["float32"],
                                 0, 0, *kv.shape, int.from_bytes(key[:4], "little"), len(payload),
                                 xxhash.xxh3_64_intdigest(payload))
    return fields + header._CHECK.pack(header._header_checksum(key, fields)) + payload
