"""The connector's worker side without vLLM, on a tensor laid out as vLLM's CPU cache: layer-by-layer
saves, async and layerwise loads, and the integrity rule (nothing unverified reaches the cache)."""

from __future__ import annotations

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.integrations.vllm.trackers import LoadSpec, SaveSpec
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.tiers.manager import build_manager

L, H, T, D, NUM_BLOCKS = 3, 2, 4, 8, 6
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=T)
SPACE = KeySpace("fp", LAYOUT, "raw")
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def layer_index(name: str) -> int:
    return int(name.split(".")[2])


def new_worker(manager) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    caches = {name: torch.randn(NUM_BLOCKS, H, T, 2 * D) for name in NAMES}  # the CPU backend's layer shape
    worker = WorkerSide(LAYOUT, get_codec("raw"), manager)
    worker.register(caches, layer_index)
    return worker, caches


def blocks_of(caches: dict[str, torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """[n, L, 2, H, T, D]: what a block holds, all layers (keys then values per head)."""
    layers = [caches[name][block_ids].view(len(block_ids), H, 2, T, D).transpose(1, 2) for name in NAMES]
    return torch.stack(layers, dim=1)


@pytest.fixture
def manager(tmp_path):
    manager = build_manager([f"shm:{tmp_path}:16MiB"], slot_bytes=1 << 16, async_writes=False)
    yield manager
    manager.close()


def save(worker: WorkerSide, specs: list[SaveSpec], layers=NAMES) -> None:
    worker.begin_step(specs)
    for name in layers:
        worker.save_layer(name)
    worker.finish_save()
    worker.wait_saves()


def test_saves_copy_layer_by_layer_and_the_step_end_copies_what_the_forward_skipped(manager):
    worker, caches = new_worker(manager)
    keys = block_keys(SPACE, list(range(3 * T)))
    save(worker, [SaveSpec("r1", keys[:2], [4, 1]), SaveSpec("r2", keys[2:], [3])], layers=NAMES[:2])
    assert worker.take_stats()["saved_blocks"] == 3
    expected = blocks_of(caches, [4, 1, 3])
    prefix = manager.read(manager.match(keys))
    for i, (hdr, data) in enumerate(zip(prefix.headers, prefix.payloads)):
        assert torch.equal(get_codec("raw").decode_verified(hdr, data), expected[i])
    worker.shutdown()


@pytest.mark.parametrize("mode", ["async", "layerwise"])
def test_loads_write_verified_blocks_and_report_the_rest(manager, tmp_path, mode):
    source, caches = new_worker(manager)
    keys = block_keys(SPACE, list(range(3 * T)))
    save(source, [SaveSpec("r0", keys, [0, 1, 2])])
    (path,) = tmp_path.glob(f"*/{keys[1].hex()}*")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)   # block 1 no longer matches its checksum

    worker, target = new_worker(manager)
    untouched = blocks_of(target, [4, 5])
    spec = LoadSpec("r1", keys, [3, 4, 5], ["shm"] * 3)  # where the scheduler found them
    if mode == "async":
        worker.start_loads([spec])
        worker.shutdown()  # drains the loader
        assert worker.take_finished_loads() == {"r1"}
    else:
        worker.begin_step([SaveSpec("r1", keys[:1], [2])])
        worker.start_layerwise([spec])
        for name in NAMES:
            worker.wait_layer(name)
            worker.save_layer(name)
        worker.finish_layerwise()
        worker.finish_save()
        worker.wait_saves()
        worker.shutdown()
    assert worker.take_invalid_block_ids() == {4, 5}
    assert torch.equal(blocks_of(target, [3]), blocks_of(caches, [0]))
    assert torch.equal(blocks_of(target, [4, 5]), untouched)  # nothing of the corrupt block or after it
    stats = worker.take_stats()
    assert (stats["loaded_blocks"], stats["failed_blocks"], stats["hit_tokens_shm"]) == (1, 2, T)
    assert "saved_blocks" not in stats  # a failed layerwise load's request saves nothing this step
    assert worker.take_loaded_tiers() == {"r1": ["shm"]}
    assert manager.tiers[0].num_leased() == 0  # the read buffers the load was served from went back
    source.shutdown()


@pytest.mark.parametrize("mode", ["async", "layerwise"])
def test_loads_from_dram_copy_straight_out_of_its_slots_and_end_every_lease(mode):
    manager = build_manager(["dram:1MiB"], slot_bytes=1 << 16, async_writes=False)
    source, caches = new_worker(manager)
    keys = block_keys(SPACE, list(range(2 * T)))
    save(source, [SaveSpec("r0", keys, [0, 1])])
    dram = manager.tiers[0]
    served = []
    lease = dram.lease_many
    dram.lease_many = lambda ks: served.append(len(ks)) or lease(ks)
    worker, target = new_worker(manager)
    spec = LoadSpec("r1", keys, [4, 5], ["dram"] * 2)
    if mode == "async":
        worker.start_loads([spec])
        worker.shutdown()
    else:
        worker.start_layerwise([spec])
        for name in NAMES:
            worker.wait_layer(name)
        worker.finish_layerwise()
        worker.shutdown()
    assert served == [2] and dram.num_leased() == 0
    assert torch.equal(blocks_of(target, [4, 5]), blocks_of(caches, [0, 1]))
    source.shutdown()
    manager.close()


@pytest.mark.parametrize("mode", ["async", "layerwise"])
def test_a_load_reads_where_the_scheduler_found_each_block_without_looking_it_up(manager, mode):
    """One lookup per SSD/shm block per load — the scheduler's: the worker reads at the tier the
    LoadSpec names (no contains, no index check), its reads counted in one view of the process's executor."""
    source, caches = new_worker(manager)
    keys = block_keys(SPACE, list(range(3 * T)))
    save(source, [SaveSpec("r0", keys, [0, 1, 2])])
    shm = manager.tiers[0]
    looked_up = []
    holds = shm._holds
    shm._holds = lambda key: looked_up.append(key) or holds(key)
    pools = []
    for n in range(2):
        worker, target = new_worker(manager)
        spec = LoadSpec(f"r{n + 1}", keys, [3, 4, 5], ["shm"] * 3)
        if mode == "async":
            worker.start_loads([spec])
        else:
            worker.start_layerwise([spec])
            for name in NAMES:
                worker.wait_layer(name)
            worker.finish_layerwise()
        worker.shutdown()
        assert torch.equal(blocks_of(target, [3, 4, 5]), blocks_of(caches, [0, 1, 2]))
        pools.append(shm._readers)
    assert looked_up == [] and pools[0] is pools[1] is not None
    source.shutdown()
