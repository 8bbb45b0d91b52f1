"""Layerwise loads from a file tier, layer by layer (issue 32 item 4), without vLLM: layer 0 of every block
reaches the cache before the last layer of any is read; a flipped byte in layer k of one SSD block fails
that block (and its request's blocks after it) only, with layers 0..k-1 proven; files of the previous
format (version 3, no layer table) load whole."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.codecs.header import verify
from kvtier.integrations.vllm.trackers import LoadSpec, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.tiers import ranged
from kvtier.tiers.manager import build_manager
from support.blocks import v3_block

# 4 layers of 32 KiB each: a block file spans several pieces past its 64 KiB head
L, H, T, D, NUM_BLOCKS = 4, 2, 16, 128, 8
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=T)
SPACE = KeySpace("fp", LAYOUT, "raw")
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
CODEC = get_codec("raw")


def new_worker(manager) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    caches = {name: torch.randn(NUM_BLOCKS, H, T, 2 * D) for name in NAMES}  # the CPU backend's layer shape
    worker = WorkerSide(LAYOUT, CODEC, manager)
    worker.register(caches, lambda name: int(name.split(".")[2]))
    return worker, caches


def layer_of(caches: dict[str, torch.Tensor], block_id: int, layer: int) -> torch.Tensor:
    return caches[NAMES[layer]][block_id].clone()


@pytest.fixture
def stack(tmp_path):
    """A DRAM-less SSD stack and its blocks: r0 (3 blocks, device blocks 0-2) and r1 (2, blocks 3-4)."""
    manager = build_manager([f"ssd:{tmp_path}:64MiB"], slot_bytes=CODEC.max_encoded_bytes(LAYOUT), async_writes=False)
    source, caches = new_worker(manager)
    keys = [block_keys(SPACE, list(range(3 * T))), block_keys(SPACE, list(range(1000, 1000 + 2 * T)))]
    source.begin_step([SaveSpec("r0", keys[0], [0, 1, 2]), SaveSpec("r1", keys[1], [3, 4])])
    for name in NAMES:
        source.save_layer(name)
    source.finish_save()
    source.wait_saves()
    source.shutdown()
    yield manager, keys, caches
    manager.close()


def load(worker: WorkerSide, keys: list[list[bytes]]) -> None:
    worker.start_layerwise([LoadSpec("r0", keys[0], [0, 1, 2], ["ssd"] * 3),
                            LoadSpec("r1", keys[1], [3, 4], ["ssd"] * 2)])


def finish(worker: WorkerSide) -> None:
    for name in NAMES:
        worker.wait_layer(name)
    worker.finish_layerwise()
    worker.shutdown()


def test_layer_0_of_every_block_is_in_the_cache_before_the_last_layer_is_read(stack, monkeypatch):
    """The read of any block's last layer is held until the forward's wait for layer 0 has returned with
    every block's layer 0 written: a load that read every block whole first would never get there."""
    manager, keys, source = stack
    hdr = verify(manager.tiers[0].get_many(keys[0][:1])[0], keys[0][0])
    last_start = hdr.layer_range(L - 1)[0]
    layer_0_in, held = threading.Event(), []
    read = ranged.RangedRead.read

    def gated_read(self, start, stop):
        if start <= last_start < stop:
            held.append(layer_0_in.wait(timeout=30))
        return read(self, start, stop)

    monkeypatch.setattr(ranged.RangedRead, "read", gated_read)
    worker, target = new_worker(manager)
    load(worker, keys)
    worker.wait_layer(NAMES[0])
    for block_id in range(5):
        assert torch.equal(layer_of(target, block_id, 0), layer_of(source, block_id, 0))
    assert held == []  # no last layer read yet
    layer_0_in.set()
    finish(worker)
    assert held == [True] * 5
    assert worker.take_invalid_block_ids() == set()
    for block_id in range(5):
        for layer in range(L):
            assert torch.equal(layer_of(target, block_id, layer), layer_of(source, block_id, layer))


@pytest.mark.parametrize("bad_layer", [0, 2])
def test_a_flipped_byte_in_layer_k_fails_that_block_and_its_requests_later_blocks_only(stack, tmp_path, bad_layer):
    """Block 1 of r0 has a flipped byte in layer k: blocks 1 and 2 are load errors (recomputed by vLLM),
    their layers before k written (each slice proven), none from k on; r0's block 0 and r1 load whole;
    the bad file is deleted and counted as corrupt."""
    manager, keys, source = stack
    (path,) = tmp_path.glob(f"*/{keys[0][1].hex()}*")
    data = bytearray(path.read_bytes())
    hdr = verify(bytes(data), keys[0][1])
    data[hdr.layer_range(bad_layer)[0] + 100] ^= 0x04
    path.write_bytes(data)
    worker, target = new_worker(manager)
    before = {(b, layer): layer_of(target, b, layer) for b in (1, 2) for layer in range(L)}
    load(worker, keys)
    finish(worker)
    assert worker.take_invalid_block_ids() == {1, 2}
    for block_id in (0, 3, 4):
        for layer in range(L):
            assert torch.equal(layer_of(target, block_id, layer), layer_of(source, block_id, layer))
    for block_id in (1, 2):
        for layer in range(L):
            expected = layer_of(source, block_id, layer) if layer < bad_layer else before[block_id, layer]
            assert torch.equal(layer_of(target, block_id, layer), expected), (block_id, layer)
    stats = worker.take_stats()
    assert (stats["loaded_blocks"], stats["failed_blocks"]) == (3, 2)
    assert not path.exists() and manager.tiers[0].stats.corrupt == 1
    assert manager.tiers[0].num_leased() == 0


def test_files_of_the_previous_format_load_whole_and_older_ones_are_misses(stack, tmp_path):
    """r0's files rewritten as version 3 wrote them (no layer table) load, proven whole; r1's block 0 as
    version 2: a miss at load (both r1 blocks recomputed), never a crash."""
    manager, keys, source = stack
    kv = torch.stack([torch.stack([layer_of(source, b, layer).view(H, 2, T, D).transpose(0, 1)
                                   for layer in range(L)]) for b in range(3)])  # [3, L, 2, H, T, D]
    for b, key in enumerate(keys[0]):
        (path,) = tmp_path.glob(f"*/{key.hex()}*")
        path.write_bytes(v3_block(kv[b], key))
    (path,) = tmp_path.glob(f"*/{keys[1][0].hex()}*")
    path.write_bytes(v3_block(torch.zeros(L, 2, H, T, D), keys[1][0], version=2))
    worker, target = new_worker(manager)
    load(worker, keys)
    finish(worker)
    assert worker.take_invalid_block_ids() == {3, 4}
    for block_id in range(3):
        for layer in range(L):
            assert torch.equal(layer_of(target, block_id, layer), layer_of(source, block_id, layer))
    assert manager.tiers[0].num_leased() == 0
