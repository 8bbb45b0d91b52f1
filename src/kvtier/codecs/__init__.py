"""Block codecs: how a block's KV becomes bytes in a tier, and back, verified.

`get_codec("raw" | "fp8" | "int8" | "int4" | "int2", each optionally "+zstd")`. The quantizers
themselves (usable on device tensors by a resident quantized cache) live in `codecs.quant`.
"""

from __future__ import annotations

from kvtier.codecs.codec import Codec
from kvtier.codecs.fp8 import Fp8Scheme
from kvtier.codecs.header import ZSTD_SUFFIX, CorruptBlockError, ForeignBlockError, Header, verify
from kvtier.codecs.kivi import IntScheme
from kvtier.codecs.raw import RawScheme
from kvtier.errors import UserError

_SCHEMES = {"raw": RawScheme, "fp8": Fp8Scheme, "int8": lambda: IntScheme(8),
            "int4": lambda: IntScheme(4), "int2": lambda: IntScheme(2)}
CODEC_NAMES = tuple(name + suffix for suffix in ("", ZSTD_SUFFIX) for name in _SCHEMES)


def get_codec(name: str) -> Codec:
    base = name.removesuffix(ZSTD_SUFFIX)
    if base not in _SCHEMES:
        raise UserError(f"unknown codec {name!r}: use one of {', '.join(_SCHEMES)}, optionally with '+zstd'")
    return Codec(_SCHEMES[base](), use_zstd=name.endswith(ZSTD_SUFFIX))


__all__ = ["CODEC_NAMES", "Codec", "CorruptBlockError", "ForeignBlockError", "Header", "get_codec", "verify"]
