"""The engine on the tiny random Llama: greedy output == model.generate, under batching, chunked
prefill, prefix sharing, preemption (full blocks back from the device or DRAM), and tier round trips."""

import sys
from pathlib import Path

import pytest

from kvtier.codecs import get_codec
from kvtier.engine import EngineConfig, LLMEngine, SamplingParams
from kvtier.tiers.manager import build_manager

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402

BLOCK = 8
NEW = 30


@pytest.fixture(scope="module")
def refs(tiny_model, tiny_prompts):
    return [reference(tiny_model.model, p, NEW) for p in tiny_prompts]


def make_engine(model, num_blocks, manager=None, **kwargs):
    kwargs.setdefault("max_prefill_tokens", 16)
    config = EngineConfig(device_kv_budget_bytes=num_blocks * model.kv_layout(BLOCK).block_bytes,
                          block_tokens=BLOCK, **kwargs)
    return LLMEngine(model, config, manager)


def run_all(engine, prompts, namespace=""):
    return engine.generate(prompts, SamplingParams(max_tokens=NEW), namespace)


def test_batched_chunked_prefill_matches_generate(tiny_model, tiny_prompts, refs):
    engine = make_engine(tiny_model, 64)
    assert run_all(engine, tiny_prompts) == refs
    stats = engine.stats()
    assert stats.num_preemptions == 0 and stats.num_device_blocks_used == 0


def test_shared_prefix_reuses_device_blocks(tiny_model, tiny_prompts, refs):
    engine = make_engine(tiny_model, 64)
    run_all(engine, [tiny_prompts[2]])
    engine.add_request("b", tiny_prompts[-1], SamplingParams(max_tokens=NEW))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [o.new_token_ids[0] for o in outputs] == refs[-1]
    assert outputs[-1].num_cached_tokens == 32 and outputs[-1].cached_tokens_by_tier == {"device": 32}


def test_requests_join_between_decode_steps(tiny_model, tiny_prompts, refs):
    engine = make_engine(tiny_model, 64)
    got = {i: [] for i in range(len(tiny_prompts))}
    engine.add_request("0", tiny_prompts[0], SamplingParams(max_tokens=NEW))
    step = 0
    while engine.has_unfinished_requests():
        if 0 < step < len(tiny_prompts):  # one new request joins after every step
            engine.add_request(str(step), tiny_prompts[step], SamplingParams(max_tokens=NEW))
        for out in engine.step():
            got[int(out.request_id)] += out.new_token_ids
        step += 1
    assert [got[i] for i in range(len(tiny_prompts))] == refs


def test_preemption_under_a_small_budget_keeps_outputs(tiny_model, tiny_prompts, refs):
    """No tiers: a preempted sequence finds what the device still caches and recomputes the rest."""
    engine = make_engine(tiny_model, 14)  # the 7 requests need ~30 blocks
    assert run_all(engine, tiny_prompts) == refs
    assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize("tier_writes", ["full", "evict"])
def test_preempted_sequences_reload_their_full_blocks_from_dram(tiny_model, tiny_prompts, refs, tier_writes):
    """With a DRAM tier a preempted sequence's full blocks are in DRAM before the device reuses their
    slots (written when full, or when evicted), so it loads them and recomputes only its partial last
    block: fewer tokens through the forward than without the tier, the same greedy tokens."""
    layout = tiny_model.kv_layout(BLOCK)
    manager = build_manager(["dram:1MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    try:
        engine = make_engine(tiny_model, 14, manager, tier_writes=tier_writes, synchronous_transfers=True)
        assert run_all(engine, tiny_prompts) == refs
        stats = engine.stats()
        # hits are counted at a request's first admission (the shared prefix); the other loads came back
        # after a preemption
        assert stats.num_preemptions > 0
        assert stats.num_blocks_loaded_from_tiers * BLOCK > stats.prefix_hit_tokens_by_tier.get("dram", 0)
        device_only = make_engine(tiny_model, 14)
        assert run_all(device_only, tiny_prompts) == refs
        assert stats.num_tokens_computed < device_only.stats().num_tokens_computed
    finally:
        manager.close()


def test_evicted_blocks_go_to_the_tiers_and_come_back(tiny_model, tiny_prompts, refs):
    layout = tiny_model.kv_layout(BLOCK)
    manager = build_manager(["dram:1MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    try:
        first = make_engine(tiny_model, 14, manager)
        assert run_all(first, tiny_prompts) == refs
        assert first.stats().num_blocks_written_to_tiers > 0
        first.flush_to_tiers()
        second = make_engine(tiny_model, 14, manager)  # a fresh device: the prefix must come from DRAM
        second.add_request("x", tiny_prompts[2], SamplingParams(max_tokens=NEW))
        outputs = []
        while second.has_unfinished_requests():
            outputs += second.step()
        assert [o.new_token_ids[0] for o in outputs] == refs[2]
        assert outputs[-1].cached_tokens_by_tier == {"dram": 32}
        other_tenant = make_engine(tiny_model, 14, manager)
        assert run_all(other_tenant, [tiny_prompts[2]], namespace="tenant-b") == [refs[2]]
        assert other_tenant.stats().prefix_hit_tokens_by_tier == {}
    finally:
        manager.close()


@pytest.mark.parametrize("tier_writes", ["full", "evict"])
def test_blocks_reach_the_tiers_when_full_or_when_evicted(tiny_model, tiny_prompts, refs, tier_writes):
    layout = tiny_model.kv_layout(BLOCK)
    manager = build_manager(["dram:1MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    try:
        first = make_engine(tiny_model, 64, manager, tier_writes=tier_writes)  # room: nothing is evicted
        assert run_all(first, [tiny_prompts[2]]) == [refs[2]]
        manager.flush()
        full_blocks = (len(tiny_prompts[2]) + NEW - 1) // BLOCK
        written = first.stats().num_blocks_written_to_tiers
        second = make_engine(tiny_model, 64, manager)  # another server on the same tiers, first still up
        assert run_all(second, [tiny_prompts[2]]) == [refs[2]]
        if tier_writes == "full":
            assert written == full_blocks and second.stats().prefix_hit_tokens_by_tier == {"dram": 32}
        else:
            assert written == 0 and second.stats().prefix_hit_tokens_by_tier == {}
        # at shutdown every cached block goes down, each key once
        first.flush_to_tiers()
        assert first.stats().num_blocks_written_to_tiers == full_blocks
    finally:
        manager.close()


def test_blocks_the_tiers_dropped_are_written_again(tiny_model, tiny_prompts, refs):
    layout = tiny_model.kv_layout(BLOCK)
    slot = get_codec("raw").max_encoded_bytes(layout)
    manager = build_manager([f"dram:{4 * slot}"], slot_bytes=slot)  # room for 4 blocks only
    try:
        engine = make_engine(tiny_model, 64, manager)
        assert run_all(engine, [tiny_prompts[2]]) == [refs[2]]
        full_blocks = (len(tiny_prompts[2]) + NEW - 1) // BLOCK
        assert engine.stats().num_blocks_written_to_tiers == full_blocks  # DRAM kept the last 4
        manager.flush()
        keys = [key for key, _ in engine.block_manager.cached_blocks()]
        assert sum(manager.contains_many(keys)) == 4
        engine.flush_to_tiers()  # the device still holds all: the dropped ones go down again, and only those
        assert engine.stats().num_blocks_written_to_tiers == full_blocks + (full_blocks - 4)
    finally:
        manager.close()


def test_substituted_tier_blocks_are_recomputed_not_served(tiny_model, tiny_prompts, refs, tmp_path):
    """Two of a prompt's block files swapped on the SSD: both intact, neither the block its key names.
    A fresh engine takes only the block before them from the tier, recomputes the rest, and its
    greedy tokens still equal generate's."""
    from kvtier.blocks import KeySpace, block_keys

    layout = tiny_model.kv_layout(BLOCK)
    manager = build_manager([f"ssd:{tmp_path}:64MiB"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    try:
        first = make_engine(tiny_model, 64, manager)
        assert run_all(first, [tiny_prompts[2]]) == [refs[2]]
        manager.flush()
        keys = block_keys(KeySpace(tiny_model.fingerprint, layout, "raw"), tiny_prompts[2])
        paths = [manager.tiers[0]._path(key) for key in keys[1:3]]
        one, two = (path.read_bytes() for path in paths)
        paths[0].write_bytes(two), paths[1].write_bytes(one)
        second = make_engine(tiny_model, 64, manager)
        assert run_all(second, [tiny_prompts[2]]) == [refs[2]]
        assert second.stats().prefix_hit_tokens_by_tier == {"ssd": BLOCK}
        assert manager.stats()["ssd"].corrupt == 2
    finally:
        manager.close()


def test_no_prefix_caching_never_hits(tiny_model, tiny_prompts, refs):
    engine = make_engine(tiny_model, 64, prefix_caching=False)
    assert run_all(engine, [tiny_prompts[2], tiny_prompts[2]]) == [refs[2], refs[2]]
    assert engine.stats().prefix_hit_tokens_by_tier == {} and not engine.block_manager.key_to_block


def test_abort_frees_blocks(tiny_model, tiny_prompts):
    engine = make_engine(tiny_model, 64, prefix_caching=False)
    engine.add_request("a", tiny_prompts[2], SamplingParams(max_tokens=NEW))
    engine.step()
    assert engine.stats().num_device_blocks_used == 5
    assert engine.abort_request("a") and not engine.abort_request("a")
    assert engine.stats().num_device_blocks_used == 0 and not engine.has_unfinished_requests()


def test_stop_token_and_max_tokens(tiny_model, tiny_prompts, refs):
    engine = make_engine(tiny_model, 64)
    stop = refs[1][3]
    [got] = engine.generate([tiny_prompts[1]], SamplingParams(max_tokens=NEW, stop_token_ids=[stop]))
    assert got == refs[1][:refs[1].index(stop) + 1]
    [got] = engine.generate([tiny_prompts[1]], SamplingParams(max_tokens=4))
    assert got == refs[1][:4]


def test_requests_that_can_never_run_are_refused(tiny_model):
    engine = make_engine(tiny_model, 4, max_model_tokens=64)
    with pytest.raises(ValueError, match="context"):
        engine.add_request("long", [5] * 64, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="budget"):
        engine.add_request("big", [5] * 30, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_seeded_sampling_is_reproducible(tiny_model, tiny_prompts):
    sampling = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=3)
    a = make_engine(tiny_model, 64).generate([tiny_prompts[0]], sampling)
    b = make_engine(tiny_model, 64).generate([tiny_prompts[0]], sampling)
    assert a == b and len(a[0]) == 10
