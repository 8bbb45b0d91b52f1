import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier.blocks import KVLayout
from kvtier.codecs import CorruptBlockError, get_codec, verify
from kvtier.codecs.header import HEADER_BYTES
from kvtier.errors import UserError
from support.blocks import v3_block

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
    assert len(buf) == CODEC.max_encoded_bytes(layout) == HEADER_BYTES + 30 * 2 * 3 * 16 * 64 * 4 + 30 * 8
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


def test_a_raw_block_carries_a_checksum_per_layer_and_each_layer_is_proven_alone():
    """A flipped byte in layer k fails that layer's check only; the header and the layer table are proven
    without the payload; decode_layer is the block's layer, a view of the buffer."""
    from kvtier.codecs.header import check_layer

    kv = torch.randn(4, 2, 2, 4, 8)
    buf = bytearray(CODEC.encode(kv, KEY))
    hdr = verify(buf, KEY, payload=False)
    assert hdr.layered and len(hdr.layer_sums) == 4 and hdr.layer_bytes == 2 * 2 * 4 * 8 * 4
    for layer in range(4):
        check_layer(hdr, KEY, buf, layer)
        assert torch.equal(CODEC.decode_layer(hdr, bytes(buf), layer), kv[layer])
    buf[hdr.layer_range(2)[0] + 5] ^= 0x10
    assert verify(buf, KEY, payload=False) == hdr  # the header and the table are intact
    for layer in (0, 1, 3):
        check_layer(hdr, KEY, buf, layer)
    with pytest.raises(CorruptBlockError, match="layer 2"):
        check_layer(hdr, KEY, buf, 2)
    with pytest.raises(CorruptBlockError):
        verify(buf, KEY)  # the whole proof checks every layer


def test_layer_checksums_are_bound_to_the_key_and_the_layer():
    """Two layers with the same bytes have different checksums, and so do the same bytes under two keys:
    a slice copied into another layer or another key's block fails."""
    from kvtier.codecs.header import check_layer

    kv = torch.zeros(2, 2, 1, 4, 4)  # both layers identical
    hdr = verify(CODEC.encode(kv, KEY), KEY)
    assert hdr.layer_sums[0] != hdr.layer_sums[1]
    other = bytes(reversed(KEY))
    assert verify(CODEC.encode(kv, other), other).layer_sums[0] != hdr.layer_sums[0]
    buf = bytearray(CODEC.encode(torch.randn(2, 2, 1, 4, 4), KEY))
    hdr = verify(buf, KEY)
    (a0, a1), (b0, b1) = hdr.layer_range(0), hdr.layer_range(1)
    buf[a0:a1], buf[b0:b1] = buf[b0:b1], buf[a0:a1]  # layers swapped
    with pytest.raises(CorruptBlockError, match="layer 0"):
        check_layer(hdr, KEY, buf, 0)


def test_a_version_3_block_is_still_read_and_an_older_one_is_rejected():
    """Blocks written before the layer table (version 3, files on disk) verify and decode as before,
    whole; a version 2 block, or a version 3 one claiming a layer table, is corrupt (a miss)."""
    from kvtier.codecs import header

    kv = torch.randn(3, 2, 2, 4, 8)
    old = v3_block(kv, KEY)
    hdr = verify(old, KEY)
    assert not hdr.layered and hdr.layer_sums == ()
    assert torch.equal(CODEC.decode(old, KEY), kv)
    bad = bytearray(old)
    bad[-1] ^= 1
    with pytest.raises(CorruptBlockError, match="payload checksum"):
        verify(bad, KEY)
    for version, flags in ((2, 0), (3, header.FLAG_LAYERS)):
        fields = bytearray(old[:header._FIELDS.size])
        fields[4:6] = version.to_bytes(2, "little")
        fields[8:10] = flags.to_bytes(2, "little")
        forged = bytes(fields) + header._CHECK.pack(header._header_checksum(KEY, bytes(fields))) + old[HEADER_BYTES:]
        with pytest.raises(CorruptBlockError, match="version|flags"):
            verify(forged, KEY)
