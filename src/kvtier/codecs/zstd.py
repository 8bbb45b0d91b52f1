"""zstd for "+zstd" codecs: level 3, one (de)compression context per thread (contexts are not thread-safe)."""

from __future__ import annotations

import threading

import zstandard

from kvtier.codecs.header import CorruptBlockError

LEVEL = 3
_local = threading.local()


def compress(data: bytes | memoryview) -> bytes:
    if not hasattr(_local, "compressor"):
        _local.compressor = zstandard.ZstdCompressor(level=LEVEL)
    return _local.compressor.compress(data)


def decompress(data: bytes | memoryview, expected_bytes: int) -> bytes:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    try:
        return _local.decompressor.decompress(data, max_output_size=expected_bytes)
    except zstandard.ZstdError as exc:
        raise CorruptBlockError(f"zstd payload does not decompress: {exc}") from exc
