"""`kvtier simulate` end to end: the JSON keys and values on a hand-made trace, `3M` sizes, the
table, the sweep's PNG, bad input as one-line errors, and the real sample trace."""

from __future__ import annotations

import json

import pytest

from kvtier.cli import main


def _trace(tmp_path, rows: list[tuple[int, list[int]]]):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": n, "output_length": 1, "hash_ids": ids})
                            + "\n" for i, (n, ids) in enumerate(rows)))
    return path


# 1000 tokens = a full 512-token block + 488; the repeat hits all 1000; [0, 2] hits block 0 only
HAND_TRACE = [(1000, [0, 1]), (1000, [0, 1]), (600, [0, 2])]


def _simulate(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *map(str, args)])
    out, err = capsys.readouterr()
    assert exc.value.code == 0, err
    return out


def _json(capsys, *args) -> dict:
    return json.loads(_simulate(capsys, *args, "--json"))


def _error(capsys, *args) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", *map(str, args)])
    out, err = capsys.readouterr()
    assert exc.value.code == 2
    assert err.startswith("kvtier: error: ") and err.count("\n") == 1, err   # one line, no traceback
    return err


def test_json_on_a_hand_made_trace(tmp_path, capsys):
    summary = _json(capsys, _trace(tmp_path, HAND_TRACE), "--hbm-kv-tokens", "4k")
    assert summary["requests"] == 3 and summary["input_tokens"] == 2600
    assert summary["hit_rate"] == summary["max_hit_rate"] == (1000 + 512) / 2600
    assert summary["hit_rate_by_tier"] == {"hbm": 1512 / 2600, "dram": 0.0, "pool": 0.0, "ssd": 0.0}
    assert summary["config"]["hbm_tokens"] == 4096
    assert summary["ttft_p99_s"] >= summary["ttft_p50_s"] > 0
    assert "local_vs_global" not in summary and "sweep" not in summary


def test_sizes_accept_suffixes_and_hbm_defaults_to_the_plan(tmp_path, capsys):
    from kvtier.sim.cluster import node_spec

    summary = _json(capsys, _trace(tmp_path, HAND_TRACE), "--model", "llama-3.1-70b", "--dram-tokens", "3M",
                    "--pool-tokens", "1.5k", "--ssd-tokens", "2G", "--nodes", "2", "--router", "best-prefix")
    c = summary["config"]
    assert (c["dram_tokens"], c["pool_tokens"], c["ssd_tokens"]) == (3 * 2**20, 1536, 2 * 2**30)
    spec = node_spec("llama-3.1-70b", "h100", 8)
    assert c["hbm_tokens"] == spec.hbm_tokens > 10**6
    assert c["kv_bytes_per_token"] == spec.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2
    assert summary["router"] == "best-prefix"
    lg = summary["local_vs_global"]       # two nodes with a DRAM-class cache: compared
    assert lg["capacity_tokens"] == 2 * 3 * 2**20 + 1536


def test_table(tmp_path, capsys):
    out = _simulate(capsys, _trace(tmp_path, HAND_TRACE), "--hbm-kv-tokens", "0", "--dram-tokens", "4k")
    for text in ("3 requests", "hbm", "dram", "pool", "ssd", "58.2%", "max (infinite)", "TTFT", "requests/s"):
        assert text in out, text


def test_sweep_prints_the_table_and_writes_the_png(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    a, b = (1024, [0, 1]), (1024, [2, 3])
    trace = _trace(tmp_path, [a, a, b, b] * 3)   # round-robin on 2 nodes: each node sees A, B, A, B, ...
    out = _simulate(capsys, trace, "--nodes", "2", "--hbm-kv-tokens", "0", "--sweep", "1k,2k,4k,8k", "--plot", png)
    assert "global /" in out and "90% of max at" in out and "83.3%" in out and f"plot written to {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    sweep = _json(capsys, trace, "--nodes", "2", "--hbm-kv-tokens", "0", "--sweep", "8k,1k,2k,4k")["sweep"]
    assert sweep["capacities_tokens"] == [1024, 2048, 4096, 8192]
    # one pool of 1k holds the last prompt (every second request hits), 2k holds both (all but the
    # first A and B); per-node caches need 2k each (4k in all) to hold both, and then miss twice per node
    assert sweep["curves"]["per-node DRAM, round-robin"] == [0.0, 0.0, 8 / 12, 8 / 12]
    assert sweep["curves"]["global pool, round-robin"] == [6 / 12, 10 / 12, 10 / 12, 10 / 12]
    assert sweep["max_hit_rate"] == 10 / 12
    assert all(0 <= v <= 10 / 12 for v in sweep["curves"]["per-node DRAM, best-prefix"])
    knees = sweep["knee_tokens"]
    assert (knees["per-node DRAM, round-robin"], knees["global pool, round-robin"]) == (None, 2048)
    assert sweep["global_over_local"] == [None, None, pytest.approx(1.25), pytest.approx(1.25)]


@pytest.mark.parametrize("args, message", [
    (["--router", "nearest"], "unknown router 'nearest'"),
    (["--dram-tokens", "3Q"], "unknown count suffix"),
    (["--ssd-tokens", "-1"], "cannot parse count"),
    (["--model", "no-such-model"], "no-such-model"),
    (["--nodes", "0"], "--nodes"),
    (["--plot", "x.png"], "--plot draws the sweep"),
    (["--sweep", "0"], "--sweep wants"),
    (["--write-policy", "around"], "write policy"),
])
def test_bad_options_are_one_line_errors(tmp_path, capsys, args, message):
    assert message in _error(capsys, _trace(tmp_path, HAND_TRACE), *args)


def test_malformed_trace_line_is_reported_with_its_line_number(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]}\n'
                    '{"timestamp": 1, "input_length": 5, "output_length": 1}\n')
    assert f"{path}:2: missing field 'hash_ids'" in _error(capsys, path)
    assert "trace file not found" in _error(capsys, tmp_path / "missing.jsonl")


def test_the_sample_trace(mooncake_trace_path, capsys, tmp_path):
    s = _json(capsys, mooncake_trace_path, "--nodes", "4", "--hbm-kv-tokens", "512k", "--dram-tokens", "2M",
              "--ssd-tokens", "8M", "--router", "round-robin")
    assert s["requests"] == 3993 and sum(s["requests_by_node"]) == 3993
    assert s["requests_by_node"] == [999, 998, 998, 998]
    assert 0 < s["hit_rate"] <= s["max_hit_rate"] < 1
    assert s["hit_rate"] == pytest.approx(sum(s["hit_rate_by_tier"].values()))
    assert s["hit_rate_by_tier"]["pool"] == 0 and all(s["hit_rate_by_tier"][t] > 0 for t in ("hbm", "dram", "ssd"))
    assert s["prefill_flops_saved"] == s["hit_tokens"] * s["config"]["flops_per_token"]
    assert s["bytes_read_by_tier"]["ssd"] == s["hit_tokens_by_tier"]["ssd"] * 131072
    assert s["ttft_p99_s"] >= s["ttft_p50_s"] > 0 and s["requests_per_s"] > 0
    lg = s["local_vs_global"]
    assert lg["capacity_tokens"] == 8 * 2**20
    assert lg["global_hit_rate"] >= lg["local_hit_rate"] and lg["ratio"] >= 1
