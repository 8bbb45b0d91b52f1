"""The threads of a load (`kvtier.transfer.executor`, ARCHITECTURE's "The threads of a load"): restores start no thread
of their own, more concurrent loads than the executor has workers (DRAM, `shm:` and SSD blocks, whole and
layer by layer, copies on helpers) all complete with the right bytes, and a leaf that fails (a corrupt
slice, a read that raises) costs its block only. The timeouts only detect a deadlock; nothing is timed."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.codecs.header import verify
from kvtier.transfer.executor import TransferExecutor, use_executor
from kvtier.tiers import DiskTier, HostTier, SharedMemoryTier
from kvtier.tiers.manager import TierManager
from kvtier.transfer import BlockMover
from kvtier.transfer.copies import CopyGroup
from kvtier.transfer.layers import restoring_layers

DEADLOCK_S = 60
LAYOUT = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, block_tokens=16)  # 16 KiB a layer: read in pieces
CODEC = get_codec("raw")
SLOT = CODEC.max_encoded_bytes(LAYOUT)
TIERS = ("dram", "shm", "ssd")


@pytest.fixture
def executor():
    """A small executor made the process's: 2 workers, room for 3 queued tasks — every load below queues."""
    small = TransferExecutor(workers=2, max_queued=3)
    previous = use_executor(small)
    yield small
    use_executor(previous)
    if not getattr(small, "stuck", False):  # after a deadlock its daemon threads are left behind
        small.close()
        assert small.num_threads == 0  # close joined every thread


@pytest.fixture
def manager(tmp_path, executor):
    shm = Path("/dev/shm") / f"kvtier-threads-{uuid.uuid4().hex[:8]}"
    manager = TierManager([HostTier(256 * SLOT, SLOT), SharedMemoryTier(shm, 256 * SLOT),
                           DiskTier(tmp_path, 256 * SLOT)])
    yield manager
    if not getattr(executor, "stuck", False):  # its writer may wait for a stuck read
        manager.close()
    shutil.rmtree(shm, ignore_errors=True)


def _load_blocks(manager: TierManager, name: str, n: int) -> tuple[list[bytes], torch.Tensor]:
    """`n` blocks of a prompt of their own, block i put only in tier i % 3 (DRAM, shm:, SSD)."""
    keys = block_keys(KeySpace(name, LAYOUT, "raw"), list(range(n * LAYOUT.block_tokens)))
    blocks = torch.randn(n, *LAYOUT.block_shape)
    for i, key in enumerate(keys):
        manager.tiers[i % 3].put_many([(key, CODEC.encode(blocks[i], key))])
    return keys, blocks


class _CopiedSink:
    """The blocks' layers copied into `dst` [n, L, 2, H, T, D] by a `CopyGroup`'s helpers."""

    def __init__(self, dst: torch.Tensor, group: CopyGroup) -> None:
        self.dst, self.group = dst.numpy(), group

    def write(self, index: int, block: torch.Tensor) -> None:
        src = block.numpy()
        for layer in range(LAYOUT.num_layers):
            self.group.add(self.dst[index, layer], src[layer])


def _restore_whole(manager: TierManager, keys: list[bytes]) -> tuple[list[str], torch.Tensor]:
    dst = torch.zeros(len(keys), *LAYOUT.block_shape)
    mover = BlockMover(manager, CODEC, layout=LAYOUT, synchronous=True)
    with CopyGroup(3) as group:
        tiers = mover.restore(manager.match(keys, pin=True), _CopiedSink(dst, group), copies=group).tiers
    return tiers, dst


def _restore_layers(manager: TierManager, matches) -> tuple[list[list[str]], list[torch.Tensor], list[list[int]]]:
    """Each match restored layer by layer: (its restored tiers, its blocks, how many blocks each layer handed over)."""
    dsts = [torch.zeros(len(match), *LAYOUT.block_shape) for match in matches]
    handed: list[list[int]] = [[] for _ in matches]
    with restoring_layers(manager, CODEC, LAYOUT, matches) as restore:
        for step in restore:
            for m, blocks in enumerate(step.blocks):
                handed[m].append(len(blocks))
                for j, kv in enumerate(blocks):
                    dsts[m][j, step.layer] = kv
        tiers = [restored.tiers for restored in restore.restored]
    return tiers, dsts, handed


def test_restores_start_no_thread(manager, executor, monkeypatch):
    keys, blocks = _load_blocks(manager, "warm", 9)
    release = threading.Event()
    warm = [executor.submit(release.wait) for _ in range(2)] + [executor.ahead(lambda: None)]  # every thread up
    assert executor.write(lambda: None)  # the writes thread too (the promotions of blocks read from below)
    release.set()
    assert all(f.result(DEADLOCK_S) is not False for f in warm)
    started: list[str] = []
    start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or start(self))
    for _ in range(10):
        tiers, dst = _restore_whole(manager, keys)
        assert len(tiers) == 9 and torch.equal(dst, blocks)
        (tiers,), (dst,), _ = _restore_layers(manager, [manager.match(keys, pin=True)])
        assert len(tiers) == 9 and torch.equal(dst, blocks)
    assert started == []


def test_more_concurrent_loads_than_workers_all_complete(manager, executor):
    loads = [_load_blocks(manager, f"load{n}", 24) for n in range(6)]
    results: dict[int, tuple] = {}

    def load(n: int) -> None:
        keys, _ = loads[n]
        if n % 2:
            results[n] = _restore_whole(manager, keys)
        else:
            (tiers,), (dst,), _ = _restore_layers(manager, [manager.match(keys, pin=True)])
            results[n] = tiers, dst

    threads = [threading.Thread(target=load, args=(n,), daemon=True) for n in range(6)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + DEADLOCK_S  # a failure detector: one wait for them all
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    executor.stuck = any(thread.is_alive() for thread in threads)
    assert not executor.stuck, "a load never finished: deadlock"
    for n, (keys, blocks) in enumerate(loads):
        tiers, dst = results[n]
        assert tiers == [TIERS[i % 3] for i in range(24)] and torch.equal(dst, blocks), n
    assert executor.num_waits > 0  # the loads met the backpressure point, and got past it
    assert executor.num_failed == 0


def test_a_failing_leaf_costs_its_block_only(manager, executor, monkeypatch):
    """Load A: its block 1's layer 5 is corrupt on the SSD; load B: the read of its block 2's later layers
    raises. Each prefix ends at that block from that layer on (the layers before stand); load C loads whole."""
    (a_keys, a_blocks), (b_keys, b_blocks), (c_keys, c_blocks) = (_load_blocks(manager, n, 6) for n in "abc")
    ssd = manager.tiers[2]
    for key in (a_keys[1], b_keys[2]):  # both on the SSD, not in DRAM or shm:
        ssd.delete(key)
        manager.tiers[0].delete(key)
        manager.tiers[1].delete(key)
    ssd.put_many([(a_keys[1], CODEC.encode(a_blocks[1], a_keys[1])), (b_keys[2], CODEC.encode(b_blocks[2], b_keys[2]))])
    path = ssd._path(a_keys[1])
    data = bytearray(path.read_bytes())
    data[verify(bytes(data), a_keys[1]).layer_range(5)[0]] ^= 0xFF
    path.write_bytes(bytes(data))
    failing = ssd._path(b_keys[2])
    read_head = DiskTier._read_head

    def head_then_failing_pieces(tier, p):
        read = read_head(tier, p)
        if p == failing and read is not None:
            def fail(start, stop):
                raise RuntimeError("a reader's bug")
            read.read = fail  # the pieces after the head and the layer table
        return read

    monkeypatch.setattr(DiskTier, "_read_head", head_then_failing_pieces)
    matches = [manager.match(keys, pin=True) for keys in (a_keys, b_keys, c_keys)]
    assert [len(m) for m in matches] == [6, 6, 6]
    tiers, dsts, handed = _restore_layers(manager, matches)
    assert handed[0] == [6] * 5 + [1] * 3 and len(tiers[0]) == 1  # layers 0-4 of every block, then block 0 only
    assert torch.equal(dsts[0][0], a_blocks[0]) and torch.equal(dsts[0][1, :5], a_blocks[1, :5])
    cut = handed[1].index(2)  # B's block 2 ends at the first layer past its head (no piece of it came in)
    assert 0 < cut < LAYOUT.num_layers and handed[1] == [6] * cut + [2] * (LAYOUT.num_layers - cut)
    assert len(tiers[1]) == 2 and torch.equal(dsts[1][:2], b_blocks[:2])
    assert torch.equal(dsts[1][2, :cut], b_blocks[2, :cut])
    assert len(tiers[2]) == 6 and torch.equal(dsts[2], c_blocks)
    assert executor.num_failed >= 1 and ssd.stats.corrupt == 1
    assert not ssd.contains_many([a_keys[1]])[0]  # the corrupt block was deleted; B's block stays (a read error)


def test_a_tier_closes_after_its_reads_in_flight_end(tmp_path, executor):
    """The executor is the process's: a tier's close waits for its own leaves (into buffers it unmaps) to end."""
    tier = DiskTier(tmp_path, 1 << 20)
    reading, release = threading.Event(), threading.Event()
    ended: list[bool] = []
    tier._reader_pool().submit(lambda: reading.set() or release.wait(DEADLOCK_S) and ended.append(True))
    assert reading.wait(DEADLOCK_S)
    closed: list[bool] = []
    closer = threading.Thread(target=lambda: tier.close() or closed.append(bool(ended)), daemon=True)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the read (it cannot end before it)
    release.set()
    closer.join(DEADLOCK_S)
    assert closed == [True]


def test_a_manager_closes_after_its_read_ahead_ends(manager, monkeypatch):
    """A stream left unfinished with its next chunk still being read: the manager's close waits for that read."""
    keys, _ = _load_blocks(manager, "ahead", 12)
    ssd = manager.tiers[2]
    reading, release = threading.Event(), threading.Event()
    lease = ssd.lease_many

    def slow(ks):  # the read-ahead's SSD read: held until released
        if threading.current_thread().name.startswith("kvtier-ahead"):
            reading.set()
            release.wait(DEADLOCK_S)
        return lease(ks)

    monkeypatch.setattr(ssd, "lease_many", slow)
    stream = manager.stream(manager.match(keys))
    next(stream)  # chunk 0 read; chunk 1 is being read ahead
    assert reading.wait(DEADLOCK_S)
    closer = threading.Thread(target=manager.close, daemon=True)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # waiting for the read-ahead
    release.set()
    closer.join(DEADLOCK_S)
    assert not closer.is_alive()
