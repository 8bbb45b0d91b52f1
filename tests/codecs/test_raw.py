import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier.blocks import KVLayout
from kvtier.codecs import CorruptBlockError, get_codec, verify
from kvtier.codecs.header import HEADER_BYTES
from kvtier.errors import UserError

CODEC = get_codec("raw")
KEY = bytes(range(16))


@settings(max_examples=30, deadline=None)
@given(shape=st.tuples(*(st.integers(1, 4) for _ in range(3)), st.integers(1, 9), st.integers(1, 8)),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), scale=st.sampled_from([0.0, 1e-30, 1.0, 6e4]))
def test_round_trip_is_bit_exact(shape, dtype, scale):
    l, _, h = shape[0], shape[1], shape[2]
    kv = (torch.randn(l, 2, h, shape[3], shape[4]) * scale).to(dtype)
    out = CODEC.decode(CODEC.encode(kv, KEY), KEY)
    assert out.dtype == dtype and out.shape == kv.shape
    assert torch.equal(out.view(torch.uint8) if dtype != torch.float32 else out.view(torch.int32),
                       kv.view(torch.uint8) if dtype != torch.float32 else kv.view(torch.int32))


def test_encoded_size_is_exact_and_non_contiguous_input_ok():
    layout = KVLayout(30, 3, 64, "float32", 16)
    kv = torch.randn(30, 2, 3, 64, 16).transpose(3, 4)  # non-contiguous [30, 2, 3, 16, 64]
    buf = CODEC.encode(kv, KEY)
    assert len(buf) == CODEC.max_encoded_bytes(layout) == HEADER_BYTES + 30 * 2 * 3 * 16 * 64 * 4
    assert torch.equal(CODEC.decode(buf, KEY), kv)


def test_decode_from_a_slice_at_an_odd_offset():
    kv = torch.randn(2, 2, 2, 5, 8)
    buf = CODEC.encode(kv, KEY)
    big = bytearray(b"x" * 7) + buf + bytearray(b"y" * 3)
    assert torch.equal(CODEC.decode(memoryview(big)[7:7 + len(buf)], KEY), kv)


def test_every_flipped_byte_is_detected():
    buf = CODEC.encode(torch.randn(1, 2, 1, 4, 4), KEY)
    for pos in range(len(buf)):
        bad = bytearray(buf)
        bad[pos] ^= 0x01
        with pytest.raises(CorruptBlockError):
            CODEC.decode(bytes(bad), KEY)


def test_truncated_and_foreign_blocks_are_rejected():
    buf = CODEC.encode(torch.randn(1, 2, 1, 4, 4), KEY)
    for cut in (0, 10, HEADER_BYTES, len(buf) - 1):
        with pytest.raises(CorruptBlockError):
            verify(buf[:cut], KEY)
    assert verify(buf, KEY).codec == "raw"
    with pytest.raises(CorruptBlockError, match="magic"):
        verify(b"NOPE" + buf[4:], KEY)


def test_unknown_codec_is_a_user_error():
    with pytest.raises(UserError, match="int3"):
        get_codec("int3")


def test_block_of_another_codec_is_foreign():
    block = get_codec("int4").encode(torch.randn(1, 2, 1, 2, 64), KEY)
    assert verify(block, KEY).codec == "int4"
    with pytest.raises(CorruptBlockError, match="foreign"):
        CODEC.decode(block, KEY)


def test_a_block_is_bound_to_its_key():
    """An intact block read under another key is foreign: a swapped or copied file is never served."""
    from kvtier.codecs import ForeignBlockError

    buf = CODEC.encode(torch.randn(1, 2, 1, 4, 4), KEY)
    other = bytes(reversed(KEY))
    with pytest.raises(ForeignBlockError, match="another key"):
        CODEC.decode(buf, other)
    same_tag = KEY[:4] + bytes(12)  # the 4-byte tag agrees: the key-seeded header checksum still refuses
    with pytest.raises(CorruptBlockError, match="another key"):
        verify(buf, same_tag)
    assert verify(buf, KEY).num_tokens == 4


def test_a_previous_format_block_is_refused():
    buf = bytearray(CODEC.encode(torch.randn(1, 2, 1, 4, 4), KEY))
    buf[4:6] = (2).to_bytes(2, "little")  # version 2: written before blocks were bound to keys
    with pytest.raises(CorruptBlockError, match="version 2"):
        verify(bytes(buf), KEY)
