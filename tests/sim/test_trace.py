"""Mooncake JSONL traces: parsing, partial last blocks, malformed lines reported with their line
number, and the recorder writing what the reader reads back."""

from __future__ import annotations

import json
import threading

import pytest

from kvtier.errors import UserError
from kvtier.sim.trace import BLOCK_TOKENS, Request, TraceRecorder, parse_request, read_trace


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _line(ts=0, n_in=1300, n_out=12, ids=(0, 1, 2)) -> str:
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": list(ids)})


def test_reads_requests_in_file_order_and_skips_blank_lines(tmp_path):
    path = _write(tmp_path, [_line(0, 1300, 12, [0, 1, 2]), "", "   ", _line(40.5, 512, 3, [7])])
    assert read_trace(path) == [Request(0.0, 1300, 12, [0, 1, 2]), Request(40.5, 512, 3, [7])]


def test_partial_last_block_holds_its_real_tokens():
    r = Request(0.0, 1300, 1, [0, 1, 2])
    assert [r.block_tokens(i) for i in range(3)] == [512, 512, 276]
    full = Request(0.0, 1024, 1, [0, 1])
    assert [full.block_tokens(i) for i in range(2)] == [512, 512]
    small = Request(0.0, 10, 1, [5, 6, 7])
    assert [small.block_tokens(i, block_tokens=4) for i in range(3)] == [4, 4, 2]


@pytest.mark.parametrize("bad, message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"timestamp": 0, "input_length": 5, "hash_ids": [0]}), "missing field 'output_length'"),
    (json.dumps({"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [0]}), "'timestamp'"),
    (json.dumps({"timestamp": 0, "input_length": "5", "output_length": 1, "hash_ids": [0]}), "'input_length'"),
    (json.dumps({"timestamp": 0, "input_length": 5, "output_length": True, "hash_ids": [0]}), "'output_length'"),
    (json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0.5]}), "'hash_ids'"),
    (json.dumps({"timestamp": 0, "input_length": 1300, "output_length": 1, "hash_ids": [0, 1]}), "too short"),
    (json.dumps({"timestamp": 0, "input_length": 100, "output_length": 1, "hash_ids": [0, 1]}), "too long"),
])
def test_malformed_line_is_reported_with_its_line_number(tmp_path, bad, message):
    path = _write(tmp_path, [_line(), "", _line(), bad, _line()])
    with pytest.raises(UserError) as exc:
        read_trace(path)
    assert str(exc.value).startswith(f"{path}:4: ")   # blank line 2 still counts
    assert message in str(exc.value)


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="trace file not found"):
        read_trace(tmp_path / "nope.jsonl")


def test_block_size_is_a_parameter():
    assert parse_request({"timestamp": 0, "input_length": 9, "output_length": 0, "hash_ids": [1, 2, 3]},
                         block_tokens=4).hash_ids == [1, 2, 3]
    with pytest.raises(ValueError, match="too long"):
        parse_request({"timestamp": 0, "input_length": 9, "output_length": 0, "hash_ids": [1, 2, 3]})


def test_recorder_writes_what_the_reader_reads(tmp_path):
    path = tmp_path / "recorded.jsonl"
    with TraceRecorder(path) as rec:
        rec.record(0, 1300, 12, [0, 1, 2])
        rec.record(12.5, BLOCK_TOKENS, 1, [0])
        with pytest.raises(UserError, match="cannot record request: 'hash_ids' too short"):
            rec.record(20, 5000, 1, [0])
        assert rec.num_records == 2
    assert read_trace(path) == [Request(0.0, 1300, 12, [0, 1, 2]), Request(12.5, 512, 1, [0])]


def test_recorder_appends_whole_lines_from_many_threads(tmp_path):
    path = tmp_path / "recorded.jsonl"
    with TraceRecorder(path) as rec:
        def work(t: int) -> None:
            for i in range(50):
                rec.record(float(i), 600, 1, [t * 1000 + i, t * 1000 + i + 500])
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    requests = read_trace(path)
    assert len(requests) == 200
    assert sorted(r.hash_ids[0] for r in requests) == sorted(t * 1000 + i for t in range(4) for i in range(50))


def test_sample_trace_parses(mooncake_trace_path):
    requests = read_trace(mooncake_trace_path)
    assert len(requests) == 3993
    assert all(len(r.hash_ids) == -(-r.input_length // BLOCK_TOKENS) for r in requests)
    assert all(0 < r.block_tokens(len(r.hash_ids) - 1) <= BLOCK_TOKENS for r in requests if r.hash_ids)
