"""Ranged reads of block files (`DiskTier.lease_layers`, `tiers/ranged.py`): the pieces cover a file once,
the bytes read equal the file's, and a file that is not a layered block is read whole."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvtier.codecs import get_codec
from kvtier.tiers import ranged
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.ranged import HEAD_BYTES, plan_pieces

KEY = bytes(range(16))


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 40), heads=st.integers(1, 4), tokens=st.sampled_from([1, 3, 16, 32]),
       dim=st.sampled_from([8, 64, 128]))
def test_the_pieces_cover_the_file_once_the_layer_table_first(layers, heads, tokens, dim):
    block = get_codec("raw").encode(torch.zeros(layers, 2, heads, tokens, dim), KEY)
    pieces = plan_pieces(len(block), block[:HEAD_BYTES])
    covered = [(0, min(len(block), HEAD_BYTES))] + sorted(pieces)
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])) and covered[-1][1] == len(block)
    assert all(start % 4096 == 0 for start, _ in pieces)  # O_DIRECT: page-aligned offsets
    if pieces:
        assert pieces[0][1] == len(block)  # the layer table's piece is read right after the head


def test_a_file_that_is_not_a_layered_block_is_read_whole_after_its_head():
    block = get_codec("int4").encode(torch.randn(30, 2, 2, 32, 64), KEY)
    assert len(block) > HEAD_BYTES and plan_pieces(len(block), block[:HEAD_BYTES]) == [(HEAD_BYTES, len(block))]
    assert plan_pieces(100, b"x" * 100) == []


def test_a_forged_header_cannot_make_the_plan_loop_or_overlap():
    """A header whose sizes agree with its file but whose layers are empty (payload < layers): one piece."""
    from kvtier.codecs import header

    num_layers, payload = 70_000, 69_999
    fields = header._FIELDS.pack(header.MAGIC, header.VERSION, 1, header.FLAG_LAYERS, 1, 0, 0, num_layers, 2, 1, 1,
                                 1, 0, payload, 0)
    size = 64 + payload + 8 * num_layers
    assert plan_pieces(size, fields + bytes(8)) == [(HEAD_BYTES, size)]


@pytest.mark.parametrize("cached", [True, False])
def test_lease_layers_reads_every_byte_of_each_file_and_releases_its_buffers(tmp_path, monkeypatch, cached):
    """From the page cache (RWF_NOWAIT) or the device (O_DIRECT where the file system has it): the same
    bytes; a missing file is None; the buffers go back at release, every piece ended."""
    if not cached:
        monkeypatch.setattr(ranged, "_NOWAIT", 0)
    tier = DiskTier(tmp_path, 1 << 30)
    codec = get_codec("raw")
    keys = [bytes([n]) * 16 for n in range(3)]
    blocks = [codec.encode(torch.randn(30, 2, 3, 32, 64), key) for key in keys[:2]]
    blocks.append(get_codec("fp8").encode(torch.randn(30, 2, 3, 32, 64), keys[2]))  # no layer table
    tier.put_many(list(zip(keys, blocks)))
    reads = tier.lease_layers(keys + [b"\x09" * 16])
    assert reads[-1] is None and tier.stats.misses == 1
    for read, block in zip(reads, blocks):
        assert read.wait(read.size) and read.view() == block
        assert len(read.pieces) == (5 if read is not reads[2] else 0)  # head and table (or all) read first
    assert tier.num_leased() == 3
    tier.release(keys)
    assert tier.num_leased() == 0 and all(read.fd == -1 for read in reads[:3])
    tier.close()
