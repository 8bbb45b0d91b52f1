"""Every block codec end to end: framing, exact sizes, compression, what a tier gives back, and
corruption of quantized and zstd'd blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from kv_strategies import make_tensor, tensors
from kvtier.blocks import KVLayout
from kvtier.codecs import CODEC_NAMES, CorruptBlockError, get_codec, verify
from kvtier.codecs.header import HEADER_BYTES
from kvtier.tiers.manager import build_manager

LAYOUT = KVLayout(num_layers=2, num_kv_heads=3, head_dim=64, dtype="bfloat16", block_tokens=256)
KEY = bytes(range(16))  # a block is bound to the key it is stored under


def _kv(kind: str = "normal", seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    return make_tensor(LAYOUT.block_shape, kind, seed, 6e4).to(dtype)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_codec_frames_verifies_and_decodes_to_the_input_shape_and_dtype(name):
    codec = get_codec(name)
    kv = _kv("outliers")
    buf = codec.encode(kv, KEY)
    hdr = verify(buf, KEY)
    assert hdr.codec == name and hdr.shape == tuple(kv.shape) and hdr.dtype == "bfloat16"
    out = codec.decode(buf, KEY)
    assert out.shape == kv.shape and out.dtype == kv.dtype
    if codec.lossless:
        assert torch.equal(out, kv)
    if "zstd" not in name:  # exact size: header + the scheme's payload formula (+ raw's layer table: 8 B a layer)
        table = 8 * LAYOUT.num_layers if name == "raw" else 0
        assert hdr.layered == (name == "raw")
        assert len(buf) == codec.max_encoded_bytes(LAYOUT) == HEADER_BYTES + codec.bytes_per_token(LAYOUT) * 256 + table
    else:
        assert len(buf) <= codec.max_encoded_bytes(LAYOUT)


@pytest.mark.parametrize("name,ratio", [("fp8", 1.8), ("int8", 1.8), ("int4", 3.5), ("int2", 6.0)])
def test_compression_against_bf16(name, ratio):
    raw = get_codec("raw").bytes_per_token(LAYOUT)
    assert raw == 2 * 2 * 3 * 64 * 2  # K and V x layers x kv heads x head_dim x 2 bytes
    assert raw / get_codec(name).bytes_per_token(LAYOUT) >= ratio


def test_zstd_shrinks_compressible_kv_and_round_trips_bit_exact():
    kv = _kv("zeros")
    kv[:, :, :, :10] = 1.5
    plain, packed = get_codec("raw").encode(kv, KEY), get_codec("raw+zstd").encode(kv, KEY)
    assert len(packed) < len(plain) / 10
    assert torch.equal(get_codec("raw+zstd").decode(packed, KEY), kv)


def test_zstd_on_incompressible_data_is_stored_not_grown():
    kv = torch.randint(-2**15, 2**15, LAYOUT.block_shape, dtype=torch.int16).view(torch.bfloat16)
    kv = torch.nan_to_num(kv.float(), nan=0.0, posinf=1.0, neginf=-1.0).to(torch.bfloat16)
    codec = get_codec("raw+zstd")
    buf = codec.encode(kv, KEY)
    assert len(buf) <= codec.max_encoded_bytes(LAYOUT)
    assert torch.equal(codec.decode(buf, KEY), kv)


@settings(max_examples=25, deadline=None)
@given(kv=tensors(rank=5))
def test_decode_is_deterministic_from_bytes_or_a_view(kv):
    """A stored quantized block decodes to the same tensor every time, whatever buffer holds it."""
    for name in ("fp8", "int8", "int4"):
        codec = get_codec(name)
        buf = codec.encode(kv, KEY)
        once = codec.decode(buf, KEY)
        assert torch.equal(once, codec.decode(memoryview(bytearray(buf)), KEY))


@pytest.mark.parametrize("name", ["fp8", "int8", "int4", "int2", "int4+zstd"])
def test_quantized_blocks_come_back_from_the_tiers_bit_exact(name, tmp_path):
    codec = get_codec(name)
    keys = [bytes([i]) * 16 for i in range(3)]
    blocks = [codec.encode(_kv("outliers", seed), keys[seed]) for seed in range(3)]
    m = build_manager(["dram:1MiB", f"ssd:{tmp_path}:64MiB"], slot_bytes=codec.max_encoded_bytes(LAYOUT))
    m.put_many(list(zip(keys, blocks)))
    m.flush()
    assert m.get_prefix(keys) == blocks  # the bytes, as stored
    assert m.tiers[1].get_many(keys) == blocks  # from the SSD too
    for buf, seed in zip(blocks, range(3)):
        assert torch.equal(codec.decode(m.get_prefix([keys[seed]])[0], keys[seed]), codec.decode(buf, keys[seed]))
    m.close()


@pytest.mark.parametrize("name", ["int4", "fp8+zstd", "int2+zstd"])
@pytest.mark.parametrize("where", ["header", "scales", "codes", "truncated"])
def test_corrupt_quantized_blocks_are_rejected(name, where):
    codec = get_codec(name)
    buf = bytearray(codec.encode(_kv("normal"), KEY))
    if where == "truncated":
        buf = buf[:-7]
    else:
        buf[{"header": 20, "scales": HEADER_BYTES + 3, "codes": len(buf) - 5}[where]] ^= 0x21
    with pytest.raises(CorruptBlockError):
        codec.decode(bytes(buf), KEY)


def test_a_block_of_one_codec_is_foreign_to_another():
    with pytest.raises(CorruptBlockError, match="foreign"):
        get_codec("int8").decode(get_codec("int4").encode(_kv(), KEY), KEY)
    with pytest.raises(CorruptBlockError, match="foreign"):
        get_codec("int4").decode(get_codec("int4+zstd").encode(_kv(), KEY), KEY)


def test_nan_kv_is_refused_with_a_clear_error():
    kv = _kv()
    kv[0, 0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="(?i)nan"):
        get_codec("int4").encode(kv, KEY)
