"""Tensor parallelism without vLLM: each rank keeps its shard of a block (its KV heads) under a key naming
rank and world size, verified against that key on the way back; the scheduler offers a block only when
every rank holds its shard."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.codecs import get_codec
from kvtier.integrations.vllm.trackers import LoadSpec, SaveSpec, for_rank, shard_keys
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.tiers.manager import build_manager

L, H_RANK, T, D, NUM_BLOCKS, WORLD = 2, 2, 4, 8, 6, 2  # 4 KV heads, 2 per rank
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H_RANK, head_dim=D, block_tokens=T)  # one rank's shard
SPACE = KeySpace("fp", LAYOUT)
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


@pytest.fixture
def manager(tmp_path):
    manager = build_manager([f"shm:{tmp_path}:16MiB"], slot_bytes=1 << 14, async_writes=False)
    yield manager
    manager.close()


def request(req_id: str, token_ids: list[int]):
    return SimpleNamespace(request_id=req_id, all_token_ids=list(token_ids), cache_salt=None, lora_request=None,
                           num_computed_tokens=0)


def test_a_blocks_rank_keys_are_derived_once():
    from kvtier.integrations.vllm.trackers import _shard_key

    keys = block_keys(SPACE, list(range(900, 920)))  # blocks no other test names
    first = _shard_key.cache_info().misses
    once = shard_keys(keys, 1, WORLD)
    assert _shard_key.cache_info().misses == first + len(keys)
    assert shard_keys(keys, 1, WORLD) == once  # asked again (each lookup, each step): no new derivation
    assert _shard_key.cache_info().misses == first + len(keys)


def test_a_block_is_a_hit_only_when_every_rank_holds_its_shard(manager):
    tokens = list(range(200, 222))  # 5 full blocks (4 offered: the last token is computed)
    keys = block_keys(SPACE, tokens)
    rank0, rank1 = shard_keys(keys, 0, WORLD), shard_keys(keys, 1, WORLD)
    assert len({*keys, *rank0, *rank1}) == 15 and shard_keys(keys, 0, 1) == keys
    assert shard_keys(keys, 1, 4) != rank1  # the world size is named too
    manager.put_many([(key, b"shard") for key in rank0[:4] + rank1[:2]])
    side = SchedulerSide(SPACE, manager, world_size=WORLD)
    assert side.num_matched_tokens(request("r1", tokens), 0) == 2 * T
    manager.put_many([(rank1[2], b"shard")])
    assert side.num_matched_tokens(request("r2", tokens), 0) == 3 * T
    assert SchedulerSide(SPACE, manager).num_matched_tokens(request("r3", tokens), 0) == 0  # one worker's keys
    assert for_rank([LoadSpec("r1", keys[:2], [4, 5], ["shm"] * 2)], 1, WORLD) == [LoadSpec("r1", rank1[:2], [4, 5], ["shm"] * 2)]


def rank_worker(manager) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    caches = {name: torch.randn(NUM_BLOCKS, H_RANK, T, 2 * D) for name in NAMES}  # CPU planes, this rank's heads
    worker = WorkerSide(LAYOUT, get_codec("raw"), manager)
    worker.register(caches, lambda name: int(name.split(".")[2]))
    return worker, caches


def test_each_rank_saves_and_loads_its_own_shard_verified_against_its_key(manager, tmp_path):
    keys = block_keys(SPACE, list(range(3 * T)))
    sources = [rank_worker(manager) for _ in range(WORLD)]
    for rank, (worker, _) in enumerate(sources):
        worker.begin_step(for_rank([SaveSpec("r0", keys, [1, 2, 3])], rank, WORLD))
        worker.finish_save()
        worker.wait_saves()
    # rank 1's shard of block 2 replaced by rank 0's: intact, but written for another key
    (src,) = tmp_path.glob(f"*/{shard_keys(keys, 0, WORLD)[2].hex()}*")
    (dst,) = tmp_path.glob(f"*/{shard_keys(keys, 1, WORLD)[2].hex()}*")
    dst.write_bytes(src.read_bytes())
    for rank, (source, source_caches) in enumerate(sources):
        target, target_caches = rank_worker(manager)
        target.start_loads(for_rank([LoadSpec("r1", keys, [0, 4, 5], ["shm"] * 3)], rank, WORLD))
        target.shutdown()
        num_loaded = 3 if rank == 0 else 2
        assert target.take_finished_loads() == {"r1"}
        assert target.take_invalid_block_ids() == {0: set(), 1: {5}}[rank]
        for name in NAMES:
            assert torch.equal(target_caches[name][[0, 4, 5][:num_loaded]], source_caches[name][[1, 2, 3][:num_loaded]])
        source.shutdown()


# -- under real vLLM (CPU build): two engine starts of three workers each --------------------------

@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_vllm_tp3_second_process_loads_every_ranks_shard(shakespeare_text, tmp_path_factory, monkeypatch):
    """SmolLM2-135M has 9 attention heads and 3 KV heads: vLLM refuses --tensor-parallel-size 2 ("Total
    number of attention heads (9) must be divisible by tensor parallel size (2)"), so TP=3 (one KV head a
    rank). vLLM's CPU build binds each worker's threads to a NUMA node of its own unless told otherwise
    ("Not enough allowed NUMA nodes to bind threads of 3 local CPUWorkers"): `nobind` here."""
    import shutil
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from vllm_support import BLOCK_TOKENS, VLLM_PYTHON, start_vllm

    if not VLLM_PYTHON.exists():
        pytest.skip(".venv-vllm is missing: `make vllm` creates it")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    shm = tempfile.mkdtemp(prefix="kvtier-tp3-", dir="/dev/shm")
    try:
        tiers, tp = [f"shm:{shm}:512MiB"], ("--tensor-parallel-size", "3")
        prompt = shakespeare_text[30000:31400]
        with start_vllm(tmp_path_factory.mktemp("vllm") / "tp3-first.log", tiers, extra_args=tp) as server:
            first = server.complete(prompt)
            log = server.log_tail(400_000)
        assert all(f"rank {r} of 3" in log for r in range(3)) and first["kvtier_hit_tokens"] == {}
        num_blocks = (len(first["prompt_token_ids"]) - 1) // BLOCK_TOKENS
        assert len(list(Path(shm).rglob("*.kvb"))) >= 3 * num_blocks  # every rank's shard of every block
        with start_vllm(tmp_path_factory.mktemp("vllm") / "tp3-second.log", tiers, extra_args=tp) as server:
            second = server.complete(prompt)
            assert server.metric("kvtier:loaded_blocks_total") == 3 * num_blocks
            assert server.metric("kvtier:hit_tokens_total", tier="shm") == num_blocks * BLOCK_TOKENS
        assert second["kvtier_hit_tokens"] == {"shm": num_blocks * BLOCK_TOKENS}
        assert second["text"] == first["text"]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
