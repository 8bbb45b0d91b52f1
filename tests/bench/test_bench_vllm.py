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
