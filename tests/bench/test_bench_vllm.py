"""`kvtier bench vllm` without starting vLLM: refused inputs, and the cached-token accounting from
two /metrics scrapes (the runs themselves are in docs/benchmarks/vllm.md; the connector's behaviour under
real vLLM is tested in tests/integrations/test_vllm.py)."""

from __future__ import annotations

import pytest

from kvtier.bench.vllm import _breakdown, _cached_tokens, render_breakdown
from kvtier.cli import main


def test_an_unknown_system_is_refused_before_anything_runs(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "vllm", "--systems", "vllm,vllm-kvtier-nvme"])
    assert exc.value.code == 2
    assert "vllm-kvtier-nvme" in capsys.readouterr().err


def test_an_unknown_load_mode_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "vllm", "--systems", "vllm-kvtier-dram", "--load", "sync"])
    assert exc.value.code == 2
    assert "layerwise or async" in capsys.readouterr().err


def test_cached_tokens_are_the_run_s_metric_deltas_by_tier():
    def sample(name, value, **labels):
        return (name, tuple(sorted(labels.items()))), value

    before = dict([sample("vllm:prefix_cache_hits_total", 100, engine="0"),
                   sample("kvtier:hit_tokens_total", 64, engine="0", tier="ssd")])
    after = dict([sample("vllm:prefix_cache_hits_total", 900, engine="0"),
                  sample("kvtier:hit_tokens_total", 320, engine="0", tier="ssd"),
                  sample("kvtier:hit_tokens_total", 96, engine="0", tier="dram")])
    assert _cached_tokens(before, after) == {"device": 800, "dram": 96, "ssd": 256}
    other = dict([sample("vllm:external_prefix_cache_hits_total", 640, engine="0")])
    assert _cached_tokens({}, other) == {"external": 640}


def test_vllm_lmcache_is_skipped_with_a_message_without_its_environment(monkeypatch, tmp_path, capsys):
    from kvtier.bench import vllm as bench_vllm
    from kvtier.bench import servers as launch

    monkeypatch.setattr(launch, "LMCACHE_PYTHON", tmp_path / "missing" / "python")
    assert bench_vllm.run(systems=("vllm-lmcache",)) == []
    assert "vllm-lmcache skipped" in capsys.readouterr().err


def test_lmcache_server_offers_the_cpu_transfer_and_vllm_connects_to_its_port(tmp_path):
    from kvtier.bench.servers import LmcacheServer

    server = LmcacheServer(tmp_path / "lmcache.log")
    argv = " ".join(server.argv)
    assert "--supported-transfer-mode engine_driven" in argv and f"--shm-name {server.shm_name}" in argv
    assert server.transfer_config() == {
        "kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": server.port}}


def test_the_breakdown_is_per_request_means_and_run_totals():
    def sample(name, value):
        return (name, (("engine", "0"),)), value

    before = dict([sample("vllm:request_queue_time_seconds_count", 2),
                   sample("vllm:request_queue_time_seconds_sum", 1.0), sample("kvtier:load_seconds_total", 0.5)])
    after = dict([sample("vllm:request_queue_time_seconds_count", 6),
                  sample("vllm:request_queue_time_seconds_sum", 9.0),
                  sample("vllm:request_prefill_time_seconds_sum", 2.0),
                  sample("vllm:request_decode_time_seconds_sum", 8.0),
                  sample("vllm:request_prefill_kv_computed_tokens_sum", 640),
                  sample("vllm:num_preemptions_total", 1), sample("kvtier:load_seconds_total", 2.0)])
    b = _breakdown(before, after)
    assert (b["queue_s_mean"], b["prefill_s_mean"], b["decode_s_mean"]) == (2.0, 0.5, 2.0)
    assert (b["computed_prompt_tokens"], b["preemptions"], b["kvtier_load_seconds"]) == (640, 1, 1.5)
    row = {"system": "x", "breakdown": b | {"load_avg": 3.0}}
    expected = "| x | 2.00 s | 0.50 s | 2.00 s | 640 | 1 | 1.50 s | 0.00 s | 0.00 s | 3.0 |"
    assert render_breakdown([row]).endswith(expected)


def test_a_disaggregated_pair_has_a_breakdown_row_for_each_engine():
    def breakdown(computed: float) -> dict[str, float]:
        return {"queue_s_mean": 0.0, "prefill_s_mean": 0.5, "decode_s_mean": 2.0, "computed_prompt_tokens": computed,
                "preemptions": 0, "kvtier_load_seconds": 0.25, "kvtier_save_copy_seconds": 0.0,
                "kvtier_save_write_seconds": 0.0, "load_avg": 3.0}

    row = {"system": "vllm-kvtier-disagg", "breakdown": breakdown(96) | {"producer": breakdown(1800)}}
    assert render_breakdown([row]).splitlines()[2:] == [
        "| vllm-kvtier-disagg (consumer) | 0.00 s | 0.50 s | 2.00 s | 96 | 0 | 0.25 s | 0.00 s | 0.00 s | 3.0 |",
        "| vllm-kvtier-disagg (producer) | 0.00 s | 0.50 s | 2.00 s | 1,800 | 0 | 0.25 s | 0.00 s | 0.00 s | 3.0 |"]


def test_the_cpu_table_is_per_output_token_by_process_and_the_connector_s_own():
    from kvtier.bench.vllm import render_cpu

    used = {"vllm:VLLM::Worker/VLLM::Worker": 30.0, "vllm:VLLM::Worker/kvtier-load": 1.5,
            "vllm:VLLM::Worker/kvtier-writes": 0.5, "vllm:VLLM::EngineCor/VLLM::EngineCor": 6.0,
            "vllm:python/python": 1.0, "lmcache:python/python": 1.0}
    rows = [{"system": "vllm-kvtier-dram", "tokens_per_s": 50.0, "wall_s": 8.0,
             "breakdown": {"cpu_s": used, "kvtier_scheduler_seconds": 0.25}},
            {"system": "kvtier-serve", "tokens_per_s": 50.0, "wall_s": 8.0, "breakdown": {}}]
    assert render_cpu(rows).splitlines()[2:] == [  # 40 s of CPU over 400 tokens; kvtier-serve: not a vLLM server
        "| vllm-kvtier-dram | 40.0 | 100.0 ms | vllm:VLLM::Worker 32.0, vllm:VLLM::EngineCor 6.0, vllm:python 1.0, "
        "lmcache:python 1.0 | 2.00 s | 0.25 s |"]


def test_decode_rounds_are_fresh_passages_that_share_no_first_block():
    from kvtier.bench.harness import Workload
    from kvtier.bench.vllm import decode_device_tokens, decode_rounds

    class Chars:  # a tokenizer of one id per character: what is shared shows exactly
        def __call__(self, text):
            return {"input_ids": [ord(c) for c in text]}

    text = "".join(chr(65 + (i * 7919) % 26) for i in range(20_000))
    rounds = decode_rounds(text, Chars(), Workload(num_users=4, num_turns=3, context_chars=300))
    assert [len(r) for r in rounds] == [4, 4, 4]
    prompts = [ids for r in rounds for ids in r]
    assert all(len(ids) == 300 for ids in prompts)
    assert len({tuple(ids[:32]) for ids in prompts}) == 12  # no block a later prompt could load
    # 4 requests x ceil((300 + 200) / 32) = 16 blocks each
    assert decode_device_tokens(rounds, 200, 32) == 4 * 16 * 32


def test_decode_figures_are_per_round_itl_and_rate_and_the_best_of_each():
    from kvtier.bench.harness import SystemResult, Turn
    from kvtier.bench.vllm import decode_figures

    result = SystemResult(name="x", wall_s=1.0)
    # round 1: two requests, first tokens at 1.0 s, 10 gaps of 0.05 s -> the round spans 0.5 s, 20 tokens
    result.turns[(1, 0)] = Turn(1.0, [0.05] * 10, list(range(11)), start_s=0.0)
    result.turns[(1, 1)] = Turn(0.9, [0.05] * 10, list(range(11)), start_s=0.1)
    # round 2: one request, gaps of 0.04 s but one stall: p50 0.04, 5 tokens over 0.36 s
    result.turns[(2, 0)] = Turn(0.5, [0.04, 0.04, 0.04, 0.04, 0.2], list(range(6)), start_s=3.0)
    d = decode_figures(result)
    assert d["round_itl_p50_s"] == pytest.approx([0.05, 0.04])
    assert d["round_decode_tokens_per_s"] == pytest.approx([20 / 0.5, 5 / 0.36])
    assert d["best_itl_p50_s"] == pytest.approx(0.04)
    assert d["best_decode_tokens_per_s"] == pytest.approx(40.0)


@pytest.mark.parametrize("system", ["kvtier-serve", "vllm-kvtier-disagg"])
def test_the_decode_workload_refuses_systems_that_are_not_one_vllm(system, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "vllm", "--workload", "decode", "--systems", f"vllm,{system}"])
    assert exc.value.code == 2
    assert "--workload decode" in capsys.readouterr().err


def test_a_system_named_twice_runs_twice_under_its_own_label():
    from kvtier.bench.vllm import run_labels

    assert run_labels(("vllm", "vllm-kvtier-dram", "vllm", "vllm-kvtier-dram", "vllm")) == [
        "vllm", "vllm-kvtier-dram", "vllm (2)", "vllm-kvtier-dram (2)", "vllm (3)"]


def test_the_decode_workload_needs_a_round_beyond_the_warm_up(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "vllm", "--workload", "decode", "--systems", "vllm", "--turns", "1"])
    assert exc.value.code == 2
    assert "at least 2" in capsys.readouterr().err
