"""`kvtier bench serve` on the tiny model: every system answers every turn with the same text."""

import pytest

from kvtier.bench.harness import Workload, conversations, render
from kvtier.bench.serve import engine_system, run


def test_conversations_are_deterministic_and_distinct(shakespeare_text):
    w = Workload(num_users=3, num_turns=2, context_chars=100, turn_chars=20)
    convs = conversations(shakespeare_text, w)
    assert convs == conversations(shakespeare_text, w)
    assert len({passage for passage, _ in convs}) == 3 and all(len(m) == 2 for _, m in convs)


def test_tiny_bench_all_systems_agree():
    w = Workload(num_users=3, num_turns=2, context_chars=200, turn_chars=40, max_tokens=6)
    rows = run(w, model="tiny", device_kv_budget="256KiB", block_tokens=16)  # 32 blocks: ~1 conversation
    by_name = {r["system"]: r for r in rows}
    assert list(by_name) == ["generate", "kvtier", "device-prefix"]
    for r in rows:
        assert r["requests"] == 6 and r["failed"] == 0
    assert by_name["kvtier"]["same_text_as_generate"] and by_name["device-prefix"]["same_text_as_generate"]
    assert "dram" in by_name["kvtier"]["cached_tokens_by_tier"]      # evicted prefixes came back from DRAM
    assert "dram" not in by_name["device-prefix"]["cached_tokens_by_tier"]
    assert render(rows).count("\n") == 4


def test_quantized_resident_system_serves_every_turn():
    w = Workload(num_users=2, num_turns=2, context_chars=200, turn_chars=40, max_tokens=6)
    rows = run(w, model="tiny", device_kv_budget="128KiB", block_tokens=16, systems=("generate", "kvtier-int8"))
    r = rows[1]
    assert r["system"] == "kvtier-int8" and r["requests"] == 4 and r["failed"] == 0
    # (whether its text equals generate's is measured, not asserted: int8 is lossy, and in float32 which
    # near-tied token flips can depend on the CPU; tests/engine checks int8 against DynamicCache in float64)


def test_plot_is_a_png_with_one_bar_group_per_system(tmp_path):
    from kvtier.bench.harness import plot

    rows = [dict(system=name, ttft_p50_s=p50, ttft_p99_s=2 * p50, tokens_per_s=tps, failed=failed)
            for name, p50, tps, failed in [("generate", 10.0, 5.0, 0), ("kvtier", 4.0, 9.0, 0),
                                           ("device-prefix", 8.0, 6.0, 1)]]
    path = tmp_path / "serve.png"
    plot(rows, path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_system_names():
    assert engine_system("kvtier") == (True, "raw")
    assert engine_system("kvtier-int4") == (True, "int4")
    assert engine_system("device-prefix") == (False, "raw")
    for gone in ("kvtier-int3", "kvtier-recompute"):  # one preemption path: no system names it
        with pytest.raises(ValueError, match=gone):
            engine_system(gone)


def test_trace_requests_keep_the_traces_prefix_sharing(mooncake_trace_path):
    from kvtier.bench.harness import trace_requests
    from kvtier.sim.trace import read_trace

    raw = read_trace(mooncake_trace_path)[:60]
    reqs = trace_requests(mooncake_trace_path, num_requests=60, block_tokens=16, max_tokens=8, vocab_size=256)
    assert len(reqs) == 60 and [r.arrival_s for r in reqs] == [t.timestamp_ms / 1000 for t in raw]
    for a, ra in zip(reqs, raw):
        assert len(a.token_ids) == sum(max(1, round(ra.block_tokens(i) * 16 / 512)) for i in range(len(ra.hash_ids)))
        assert 1 <= a.max_tokens <= 8
    # two requests share a token prefix exactly as long as their shared leading block ids
    pairs = [(i, j) for i in range(60) for j in range(i) if raw[i].hash_ids[0] == raw[j].hash_ids[0]]
    assert pairs
    for i, j in pairs:
        shared = next((k for k, (x, y) in enumerate(zip(raw[i].hash_ids, raw[j].hash_ids)) if x != y),
                      min(len(raw[i].hash_ids), len(raw[j].hash_ids)))
        full = min(shared, len(raw[i].hash_ids) - 1, len(raw[j].hash_ids) - 1)
        assert reqs[i].token_ids[:16 * full] == reqs[j].token_ids[:16 * full]


def test_trace_requests_from_a_later_start(mooncake_trace_path):
    from kvtier.bench.harness import trace_requests
    from kvtier.sim.trace import read_trace

    raw = read_trace(mooncake_trace_path)[100:110]
    reqs = trace_requests(mooncake_trace_path, num_requests=10, start=100, vocab_size=256)
    assert [r.arrival_s for r in reqs] == [(t.timestamp_ms - raw[0].timestamp_ms) / 1000 for t in raw]
    assert reqs[0].arrival_s == 0.0
    assert trace_requests(mooncake_trace_path, num_requests=10, start=100, vocab_size=256)[3].token_ids == \
        reqs[3].token_ids


def test_tiny_trace_replay_all_systems_agree():
    from kvtier.bench.serve import run_trace

    rows = run_trace(model="tiny", num_requests=12, trace_block_tokens=4, max_tokens=4, time_scale=0.001,
                     device_kv_budget="256KiB", block_tokens=8)  # 64 blocks: ~1.5 requests
    by_name = {r["system"]: r for r in rows}
    for r in rows:
        assert r["requests"] == 12 and r["failed"] == 0
    assert by_name["kvtier"]["same_text_as_generate"] and by_name["device-prefix"]["same_text_as_generate"]
