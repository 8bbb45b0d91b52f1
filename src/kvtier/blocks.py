"""Block layout and block keys.

A block holds all layers' K and V for `block_tokens` consecutive tokens:
    kv: [num_layers, 2, num_kv_heads, block_tokens, head_dim]   (2 = K, V)
Its key chains the parent block's key with the block's token ids, so a key names the whole prefix
up to and including the block. Keys are 16-byte xxh3-128 digests over a canonical encoding: the same
on every process and machine (never Python's `hash`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np
import xxhash

DEFAULT_BLOCK_TOKENS = 256
DEFAULT_NAMESPACE = ""
KEY_BYTES = 16

_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
                "uint8": 1, "int8": 1}


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The shape of one block's KV, and the model it came from. `latent`: MLA's one latent vector per token
    (no separate V; `num_kv_heads` 1, `head_dim` the latent width), a block [L, 1, 1, T, D]. `page`: names a
    byte order inside the K and V halves other than [H, T, D] each (an engine kernel's packing, e.g. vLLM's
    CPU attention, "cpu_attn:vec"); "" is kvtier's own."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"  # the model's KV dtype, torch name without "torch."
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    latent: bool = False
    page: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVLayout.{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"unsupported KV dtype {self.dtype!r}")
        if self.latent and self.num_kv_heads != 1:
            raise ValueError(f"an MLA latent layout has one head slot, got {self.num_kv_heads}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, self.num_parts, self.num_kv_heads, self.block_tokens, self.head_dim)

    @property
    def num_parts(self) -> int:
        """2 (K, V), or 1 (MLA's latent)."""
        return 1 if self.latent else 2

    @property
    def bytes_per_token(self) -> int:
        """parts (K,V) x layers x kv heads x head dim x element bytes."""
        return self.num_parts * self.num_layers * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_tokens

    def encode(self) -> bytes:
        parts = [f"{self.num_layers}/{self.num_kv_heads}/{self.head_dim}/{self.dtype}/{self.block_tokens}"]
        parts += ["latent"] * self.latent + [f"page={self.page}"] * bool(self.page)
        return "/".join(parts).encode()


@dataclass(frozen=True, slots=True)
class KeySpace:
    """Everything besides the tokens that makes two blocks interchangeable.

    A block is only reusable by a request with the same model weights (`model_fingerprint`), the
    same layout, the same codec (lossy codecs give different KV) and the same tenant (`namespace`,
    vLLM's `cache_salt`; "" is the shared default).
    """

    model_fingerprint: str
    layout: KVLayout
    codec: str = "raw"
    namespace: str = DEFAULT_NAMESPACE

    def root_key(self) -> bytes:
        h = xxhash.xxh3_128()
        for part in (b"kvtier/v1", self.model_fingerprint.encode(), self.layout.encode(),
                     self.codec.encode(), self.namespace.encode()):
            h.update(struct.pack("<I", len(part)))
            h.update(part)
        return h.digest()

    def with_namespace(self, namespace: str) -> "KeySpace":
        return KeySpace(self.model_fingerprint, self.layout, self.codec, namespace)


def key_codec(tier_codec: str, resident_codec: str = "raw") -> str:
    """The `KeySpace.codec` of blocks written through `tier_codec` by a cache whose resident KV is in
    `resident_codec`. A quantized resident format changes the KV itself (every later layer and token
    attended to quantized KV), so its blocks must never meet those of a full-precision cache."""
    return tier_codec if resident_codec == "raw" else f"{tier_codec}/resident-{resident_codec}"


def chain_key(parent_key: bytes, block_token_ids: Sequence[int] | np.ndarray) -> bytes:
    """H(parent_key, token ids); token ids are hashed as little-endian int64."""
    assert len(parent_key) == KEY_BYTES, len(parent_key)
    tokens = np.ascontiguousarray(np.asarray(block_token_ids, dtype="<i8"))
    h = xxhash.xxh3_128(parent_key)
    h.update(struct.pack("<I", tokens.size))
    h.update(tokens.tobytes())
    return h.digest()


class KeyChain:
    """One sequence's block keys, grown with its tokens and never rehashed (vLLM's
    `Request.block_hashes`): every stage that needs them (lookup, load, registration, saves) reads
    this list. The tokens passed must extend those passed before (the same sequence)."""

    def __init__(self, space: KeySpace) -> None:
        self.space = space
        self.keys: list[bytes] = []

    def extend(self, token_ids: Sequence[int] | np.ndarray, num_blocks: int | None = None) -> list[bytes]:
        """Keys of the first `num_blocks` full blocks of `token_ids` (default: every full block),
        hashing only the blocks not keyed yet."""
        block_tokens = self.space.layout.block_tokens
        if num_blocks is None:
            num_blocks = len(token_ids) // block_tokens
        assert num_blocks * block_tokens <= len(token_ids), (num_blocks, len(token_ids))
        if len(self.keys) < num_blocks:
            tokens = np.asarray(token_ids[len(self.keys) * block_tokens:num_blocks * block_tokens], dtype=np.int64)
            parent = self.keys[-1] if self.keys else self.space.root_key()
            for start in range(0, tokens.size, block_tokens):
                parent = chain_key(parent, tokens[start:start + block_tokens])
                self.keys.append(parent)
        return self.keys[:num_blocks]

    def reset(self) -> None:
        self.keys = []


def block_keys(space: KeySpace, token_ids: Sequence[int] | np.ndarray) -> list[bytes]:
    """Keys of every *full* block of `token_ids` (a trailing partial block gets no key)."""
    return KeyChain(space).extend(token_ids)
