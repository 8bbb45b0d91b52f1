"""The vLLM worker's DRAM tier (its own LRU, which the scheduler cannot see) and a turn's saves: a `SaveSpec`
carries only the step's new blocks and, in `held_keys`, the chain they extend; the worker's save refreshes
that chain with them, tail first, so a full DRAM evicts other requests before the root the turn extends.

Request A's turn 1 (4 blocks), then request B (4), then A's turn 2 (2 new blocks, `held_keys` = turn 1's),
then C (4), through a DRAM of 10 blocks: A's whole chain is still a prefix of what DRAM holds."""

from __future__ import annotations

import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.integrations.vllm.trackers import SaveSpec, for_rank, shard_keys
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.tiers.manager import build_manager

L, H, T, D, NUM_BLOCKS = 2, 2, 4, 8, 6
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=T)
SPACE = KeySpace("fp", LAYOUT, "raw")
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
SLOT_BYTES = get_codec("raw").max_encoded_bytes(LAYOUT)


def _save(worker: WorkerSide, specs: list[SaveSpec]) -> None:
    worker.begin_step(specs)
    for name in NAMES:
        worker.save_layer(name)
    worker.finish_save()
    worker.wait_saves()


def test_a_turn_s_save_refreshes_its_conversation_in_the_worker_s_dram():
    manager = build_manager([f"dram:{10 * SLOT_BYTES}"], slot_bytes=SLOT_BYTES)
    worker = WorkerSide(LAYOUT, get_codec("raw"), manager)
    worker.register({name: torch.randn(NUM_BLOCKS, H, T, 2 * D) for name in NAMES}, lambda n: int(n.split(".")[2]))
    try:
        a = block_keys(SPACE, list(range(6 * T)))
        b, c = block_keys(SPACE, list(range(1000, 1000 + 4 * T))), block_keys(SPACE, list(range(2000, 2000 + 4 * T)))
        _save(worker, [SaveSpec("a-turn1", a[:4], [0, 1, 2, 3])])
        _save(worker, [SaveSpec("b", b, [0, 1, 2, 3])])
        _save(worker, [SaveSpec("a-turn2", a[4:], [4, 5], held_keys=a[:4])])  # turn 1's from vLLM's prefix cache
        assert worker.take_stats()["saved_blocks"] == 10  # the held blocks refreshed, not written again
        _save(worker, [SaveSpec("c", c, [0, 1, 2, 3])])
        assert manager.match(a).keys == a  # turn 2's whole chain, root first
        assert manager.contains_many(b) == [False] * 4 and manager.contains_many(c) == [True] * 4
    finally:
        worker.shutdown()
        manager.close()


def test_each_rank_refreshes_its_own_shards_of_the_chain():
    keys = block_keys(SPACE, list(range(3 * T)))
    spec = SaveSpec("r", keys[2:], [5], held_keys=keys[:2])
    assert for_rank([spec], 1, 2) == [SaveSpec("r", shard_keys(keys[2:], 1, 2), [5], shard_keys(keys[:2], 1, 2))]
    assert for_rank([spec], 0, 1) == [spec]
