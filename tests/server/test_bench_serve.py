"""`kvtier bench serve` on the tiny model: every system answers every turn with the same text."""

from kvtier.bench.serve import Workload, conversations, render, run


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
