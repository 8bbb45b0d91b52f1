"""The engine's tier I/O runs on the transfer worker: a sequence whose prefix is loading waits in
WAITING_FOR_KV while the others keep stepping; every tier read and write happens off the step
thread; an aborted load is dropped (its blocks freed once it returns); results equal generate's."""

import sys
import threading
from pathlib import Path

from kvtier.codecs import get_codec
from kvtier.engine import SamplingParams
from kvtier.engine.sequence import SeqStatus
from kvtier.tiers.manager import build_manager

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402
from test_engine import BLOCK, NEW, make_engine, run_all  # noqa: E402


def _manager(model, tmp_path):
    slot = get_codec("raw").max_encoded_bytes(model.kv_layout(BLOCK))
    return build_manager(["dram:1MiB", f"ssd:{tmp_path}:64MiB"], slot_bytes=slot)


def _gate_reads(tier) -> threading.Event:
    """Make the tier's reads (copies and leases) wait for the returned event (a slow pool or disk)."""
    gate = threading.Event()
    for name in ("get_many", "lease_many"):
        if hasattr(tier, name):
            def slow(keys, _read=getattr(tier, name)):
                assert gate.wait(30), "the test never opened the gate"
                return _read(keys)

            setattr(tier, name, slow)
    return gate


def _drain(engine, outputs):
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)


def test_a_loading_sequence_waits_while_the_others_decode(tiny_model, tiny_prompts, tmp_path):
    prompt, other = tiny_prompts[2], tiny_prompts[1]
    expected = reference(tiny_model.model, prompt, NEW)
    manager = _manager(tiny_model, tmp_path)
    try:
        assert run_all(make_engine(tiny_model, 64, manager), [prompt]) == [expected]
        for key in list(manager.tiers[0]._key_to_slot):  # the prefix is on the SSD only
            manager.tiers[0].delete(key)
        gate = _gate_reads(manager.tiers[1])
        engine = make_engine(tiny_model, 64, manager)
        engine.add_request("other", other, SamplingParams(max_tokens=NEW))
        engine.step()  # "other" is running
        engine.add_request("cached", prompt, SamplingParams(max_tokens=NEW))
        outputs: dict[str, list[int]] = {}
        for _ in range(5):  # the SSD read is stuck: "cached" waits, "other" decodes a token per step
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        assert engine.scheduler.loading["cached"].status is SeqStatus.WAITING_FOR_KV
        assert engine.stats().num_waiting_for_kv == 1
        assert len(outputs["other"]) == 5 and "cached" not in outputs
        gate.set()
        _drain(engine, outputs)
        assert outputs["cached"] == expected
        assert engine.stats().prefix_hit_tokens_by_tier == {"ssd": 32}
        assert manager.tiers[0].num_leased() == 0  # every DRAM lease ended once its blocks were copied
    finally:
        manager.close()


def test_an_aborted_load_is_dropped_and_its_blocks_reused(tiny_model, tiny_prompts, tmp_path):
    prompt = tiny_prompts[2]
    refs = [reference(tiny_model.model, p, NEW) for p in tiny_prompts[:3]]
    manager = _manager(tiny_model, tmp_path)
    try:
        run_all(make_engine(tiny_model, 64, manager), [prompt])
        gate = _gate_reads(manager.tiers[0])
        engine = make_engine(tiny_model, 9, manager)  # 9 blocks: the aborted request's are needed again
        engine.add_request("doomed", prompt, SamplingParams(max_tokens=NEW))
        engine.step()
        assert "doomed" in engine.scheduler.loading
        num_loading = engine.scheduler.loading["doomed"].num_loading_blocks
        assert num_loading > 0
        assert engine.abort_request("doomed")
        # the worker may be writing the load's blocks: they stay taken until the load returns
        assert engine.block_manager.num_used_blocks == num_loading
        for i, p in enumerate(tiny_prompts[:2]):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=NEW))
        outputs: dict[str, list[int]] = {}
        for out in engine.step():  # r0 / r1 get blocks other than the doomed load's
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        gate.set()  # the doomed load lands now, into its own blocks; then they are freed and reused
        _drain(engine, outputs)
        assert [outputs["r0"], outputs["r1"]] == refs[:2]
        assert "doomed" not in outputs
        assert engine.block_manager.num_used_blocks == 0
        assert manager.tiers[0].num_leased() == 0  # the dropped load's leases ended too
    finally:
        manager.close()


def test_no_tier_io_on_the_step_thread_but_the_match(tiny_model, tiny_prompts, tmp_path):
    """Reads, writes and the write-back check run on the worker threads; the step thread only asks
    once per tier at admission (the match, which pins what the load will read)."""
    manager = _manager(tiny_model, tmp_path)
    calls: list[tuple[str, str]] = []
    for tier in manager.tiers:
        for name in ("get_many", "lease_many", "put_many", "contains_many", "pin_many"):
            if not hasattr(tier, name):
                continue
            method = getattr(tier, name)

            def recorded(*args, _method=method, _name=name, **kwargs):
                calls.append((_name, threading.current_thread().name))
                return _method(*args, **kwargs)

            setattr(tier, name, recorded)
    try:
        refs = [reference(tiny_model.model, p, NEW) for p in tiny_prompts[2:3]]
        first = make_engine(tiny_model, 12, manager)  # small: evictions write back too
        assert run_all(first, tiny_prompts[:3]) == [reference(tiny_model.model, p, NEW) for p in tiny_prompts[:3]]
        first.flush_to_tiers()
        second = make_engine(tiny_model, 64, manager)
        assert run_all(second, tiny_prompts[2:3]) == refs
        assert second.stats().prefix_hit_tokens_by_tier == {"dram": 32}
        step_thread = threading.current_thread().name
        on_step = {name for name, thread in calls if thread == step_thread}
        assert on_step == {"pin_many"}
        assert {name for name, _ in calls} == {"lease_many", "put_many", "contains_many", "pin_many"}
    finally:
        manager.close()


def _record_loads(engine) -> list:
    jobs = []
    load = engine.transfer.load

    def recorded(job):
        jobs.append(job)
        load(job)

    engine.transfer.load = recorded
    return jobs


def test_a_load_beside_no_forward_copies_on_the_copy_threads(tiny_model, tiny_prompts, tmp_path, monkeypatch):
    """An idle engine's load (its step computes nothing) copies on `copy_threads()` threads; a load
    beside another request's forward on one. Both land the exact KV: the tokens are generate's."""
    import kvtier.engine.engine

    monkeypatch.setattr(kvtier.engine.engine, "copy_threads", lambda: 3)
    prompt, other = tiny_prompts[2], tiny_prompts[1]
    expected = reference(tiny_model.model, prompt, NEW)
    manager = _manager(tiny_model, tmp_path)
    try:
        assert run_all(make_engine(tiny_model, 64, manager), [prompt]) == [expected]
        engine = make_engine(tiny_model, 64, manager)
        jobs = _record_loads(engine)
        outputs: dict[str, list[int]] = {}
        engine.add_request("alone", prompt, SamplingParams(max_tokens=NEW))
        _drain(engine, outputs)
        assert [job.copy_threads for job in jobs] == [3]
        engine = make_engine(tiny_model, 64, manager)
        jobs = _record_loads(engine)
        engine.add_request("other", other, SamplingParams(max_tokens=NEW))
        engine.step()  # "other" is running: the next step computes its tokens beside the load
        engine.add_request("beside", prompt, SamplingParams(max_tokens=NEW))
        _drain(engine, outputs)
        assert [job.copy_threads for job in jobs] == [1]
        assert outputs["alone"] == outputs["beside"] == expected
        assert outputs["other"] == reference(tiny_model.model, other, NEW)
        assert manager.tiers[0].num_leased() == 0
    finally:
        manager.close()


def test_a_failed_copy_on_a_copy_thread_computes_the_blocks(tiny_model, tiny_prompts, tmp_path, monkeypatch):
    """A copy that raises on a helper thread: the load comes back empty (its blocks may be half-written),
    the request computes its prompt, its tokens are generate's, every lease ends."""
    import numpy as np

    import kvtier.engine.engine

    monkeypatch.setattr(kvtier.engine.engine, "copy_threads", lambda: 2)
    prompt = tiny_prompts[2]
    expected = reference(tiny_model.model, prompt, NEW)
    manager = _manager(tiny_model, tmp_path)
    try:
        assert run_all(make_engine(tiny_model, 64, manager), [prompt]) == [expected]
        engine = make_engine(tiny_model, 64, manager)
        write_block = engine.transfer.write_block

        def failing(block_id, kv, copies):
            write_block(block_id, kv, copies)
            copies.add(np.zeros(3, np.uint8), np.zeros(5, np.uint8))  # cannot broadcast: raises on a helper

        engine.transfer.write_block = failing
        assert run_all(engine, [prompt]) == [expected]
        stats = engine.stats()
        assert stats.prefix_hit_tokens_by_tier == {} and stats.num_blocks_loaded_from_tiers == 0
        assert manager.tiers[0].num_leased() == 0
    finally:
        manager.close()
