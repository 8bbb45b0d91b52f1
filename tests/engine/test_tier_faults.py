"""Tier faults under a running engine: the outputs never change, only where the prefix comes from."""

import errno
import os
import sys
import time
from pathlib import Path

import pytest

from kvtier.codecs import get_codec
from kvtier.engine import EngineConfig, LLMEngine, SamplingParams
from kvtier.tiers.manager import TierManager
from kvtier.tiers import Backoff, DiskTier, HostTier

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402

BLOCK = 8
NEW = 30
FAST = Backoff(start_s=0.02, max_s=0.16)


@pytest.fixture(scope="module")
def refs(tiny_model, tiny_prompts):
    return [reference(tiny_model.model, p, NEW) for p in tiny_prompts]


def _engine(model, manager):
    config = EngineConfig(device_kv_budget_bytes=14 * model.kv_layout(BLOCK).block_bytes, block_tokens=BLOCK,
                          max_prefill_tokens=16)
    return LLMEngine(model, config, manager)


def _steps(engine, prompt):
    engine.add_request("x", prompt, SamplingParams(max_tokens=NEW))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.01)
    return predicate()


def test_full_ssd_still_serves_its_prefixes(tiny_model, tiny_prompts, refs, tmp_path, monkeypatch):
    manager = TierManager([DiskTier(tmp_path, 64 << 20)], backoff=FAST)
    ssd = manager.tiers[0]
    try:
        first = _engine(tiny_model, manager)
        assert first.generate(tiny_prompts, SamplingParams(max_tokens=NEW)) == refs
        first.flush_to_tiers()

        def full(path, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(DiskTier, "_write", staticmethod(full))
        monkeypatch.setattr(os, "statvfs", lambda path: os.statvfs_result((4096, 4096, 1, 1, 0, 1, 1, 1, 0, 255)))
        other = _engine(tiny_model, manager)  # new blocks (another tenant): their writes fail
        assert other.generate(tiny_prompts[:3], SamplingParams(max_tokens=NEW), "tenant-b") == refs[:3]
        other.flush_to_tiers()
        assert ssd.health.state == "read-only" and ssd.stats.errors == 1
        second = _engine(tiny_model, manager)  # a fresh device: the prefix must come from the full SSD
        outputs = _steps(second, tiny_prompts[2])
        assert [o.new_token_ids[0] for o in outputs] == refs[2]
        assert outputs[-1].cached_tokens_by_tier == {"ssd": 32}
        assert ssd.health.state == "read-only"  # the probe wants room: still not writable
    finally:
        monkeypatch.undo()
        manager.close()


def test_dram_that_raises_comes_back_and_serves_again(tiny_model, tiny_prompts, refs, monkeypatch):
    layout = tiny_model.kv_layout(BLOCK)
    dram = HostTier(1 << 20, get_codec("raw").max_encoded_bytes(layout))
    manager = TierManager([dram], backoff=FAST)
    try:
        first = _engine(tiny_model, manager)
        assert first.generate(tiny_prompts, SamplingParams(max_tokens=NEW)) == refs
        first.flush_to_tiers()

        def bug(keys):
            raise RuntimeError("a tier bug")

        monkeypatch.setattr(dram, "contains_many", bug)
        monkeypatch.setattr(dram, "pin_many", bug)  # the engine's lookup pins what its load will read
        monkeypatch.setattr(dram, "reconnect", lambda: False)
        broken = _engine(tiny_model, manager)
        outputs = _steps(broken, tiny_prompts[2])  # recomputed: the tier is off
        assert [o.new_token_ids[0] for o in outputs] == refs[2] and outputs[-1].cached_tokens_by_tier == {}
        assert dram.health.state == "down"
        monkeypatch.undo()
        assert _wait(lambda: dram.health.healthy)  # the retry thread, no request needed
        again = _engine(tiny_model, manager)
        outputs = _steps(again, tiny_prompts[2])
        assert [o.new_token_ids[0] for o in outputs] == refs[2]
        assert outputs[-1].cached_tokens_by_tier == {"dram": 32}
    finally:
        monkeypatch.undo()
        manager.close()
