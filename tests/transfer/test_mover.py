"""The block mover on its own: restore into a sink (each block verified before its write; a failed
write or a bad block ends the prefix, the blocks before it stand), blocks valid until the restore
ends (a sink may write layer by layer), and the one save queue (full: dropped and counted)."""

import threading

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.tiers import DiskTier, HostTier
from kvtier.tiers.manager import TierManager
from kvtier.transfer import BlockMover
from support.blocks import BLOCKS, CODEC, KEYS, LAYOUT, SLOT


@pytest.fixture
def manager(tmp_path):
    manager = TierManager([HostTier(8 * SLOT, SLOT), DiskTier(tmp_path, 64 * SLOT)])
    manager.put_many([(key, CODEC.encode(block, key)) for key, block in zip(KEYS, BLOCKS)])
    manager.flush()
    yield manager
    manager.close()


class Sink:
    def __init__(self, fail_at: int | None = None) -> None:
        self.written: dict[int, torch.Tensor] = {}
        self.fail_at = fail_at

    def write(self, index: int, block: torch.Tensor) -> None:
        if index == self.fail_at:
            raise RuntimeError("the destination is gone")
        self.written[index] = block.clone()


def test_restore_writes_every_verified_block_in_order(manager):
    mover = BlockMover(manager, CODEC, layout=LAYOUT, synchronous=True)
    manager.tiers[0].delete(KEYS[2])  # from the SSD
    sink = Sink()
    restored = mover.restore(manager.match(KEYS, pin=True), sink)
    assert restored.tiers == ["dram", "dram", "ssd", "dram"]
    assert all(torch.equal(sink.written[i], BLOCKS[i]) for i in range(4))
    assert manager.tiers[0].num_leased() == 0 and mover.stats.num_blocks_restored == 4


def test_a_failed_write_or_a_bad_block_ends_the_restore_and_the_blocks_before_stand(manager, tmp_path):
    mover = BlockMover(manager, CODEC, layout=LAYOUT, synchronous=True)
    assert mover.restore(manager.match(KEYS), Sink(fail_at=2)).tiers == ["dram", "dram"]
    assert mover.stats.errors == 1 and manager.tiers[0].num_leased() == 0
    wrong = BlockMover(manager, CODEC, layout=KVLayout(num_layers=3, num_kv_heads=1, head_dim=4, block_tokens=4),
                       synchronous=True)
    assert len(wrong.restore(manager.match(KEYS), Sink())) == 0  # another shape: nothing written


def test_blocks_stay_valid_until_the_restore_ends_for_a_sink_that_writes_layer_by_layer(manager):
    mover = BlockMover(manager, CODEC, layout=LAYOUT, synchronous=True)
    kept = []

    class Gather:
        def write(self, index, block):
            kept.append(block)  # no copy: written later, layer by layer

    dram = manager.tiers[0]
    with mover.restoring(manager.match(KEYS), Gather()) as restored:
        assert len(restored) == 4 and dram.num_leased() == 4  # DRAM slots lent until the exit
        layers = [torch.stack([block[layer] for block in kept]) for layer in range(LAYOUT.num_layers)]
    assert dram.num_leased() == 0
    assert torch.equal(layers[1], torch.stack([b[1] for b in BLOCKS]))


def test_saves_go_through_the_one_writer_and_a_full_one_drops(tmp_path):
    """One queue for saves, write-through and promotions (the manager's writer): a save's put writes
    through on that thread, and a full queue drops the save, counted once for the process."""
    manager = TierManager([HostTier(8 * SLOT, SLOT), DiskTier(tmp_path, 64 * SLOT)], max_pending_writes=1)
    gate = threading.Event()
    put = manager.put_many
    manager.put_many = lambda items, **kw: gate.wait(30) and put(items, **kw)
    mover = BlockMover(manager, CODEC, layout=LAYOUT)
    keys = block_keys(KeySpace("other", LAYOUT, "raw"), list(range(12)))
    assert mover.save(keys[:1], BLOCKS[:1])  # taken by the writer thread, stuck in put_many
    deadline = threading.Event()
    while manager._writeback.num_queued:
        deadline.wait(0.01)
    assert mover.save(keys[1:2], BLOCKS[1:2])  # queued
    assert not mover.save(keys[2:3], BLOCKS[2:3])  # the queue is full: dropped, never blocks
    gate.set()
    mover.close()
    assert (mover.stats.num_blocks_saved, mover.stats.num_blocks_dropped) == (2, 1)
    assert manager.num_dropped_writes == 1 and manager.num_pending_writes == 0
    assert manager.contains_many(keys[:3]) == [True, True, False]
    ssd = manager.tiers[1]
    assert ssd.contains_many(keys[:2]) == [True, True]  # written through on the writer thread, no second queue
    manager.close()
