"""Block codecs: how a block's KV becomes bytes in a tier, and back, verified.

Implemented: `raw` (bit-exact). Planned (issue 3/5): fp8, int8, int4/int2 KIVI, `+zstd`.
"""

from __future__ import annotations

from kvtier.codecs.header import CorruptBlockError, verify
from kvtier.codecs.raw import RawCodec
from kvtier.errors import UserError

_CODECS = {"raw": RawCodec}


def get_codec(name: str):
    if name not in _CODECS:
        raise UserError(f"unknown or not yet implemented codec {name!r}: available {', '.join(_CODECS)}")
    return _CODECS[name]()


__all__ = ["CorruptBlockError", "get_codec", "verify"]
