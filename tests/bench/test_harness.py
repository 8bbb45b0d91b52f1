"""The bench harness's per-request timeline (`kvtier bench vllm --timeline`, `bench serve`): when each
request was submitted, got its first token and its last, and the gaps between."""

from __future__ import annotations

import time

import pytest

from kvtier.bench.harness import SystemResult, Turn, TurnClock, plot_timeline


def test_a_turn_knows_when_each_of_its_tokens_arrived():
    turn = Turn(ttft_s=0.5, itl_s=[0.1, 0.25], token_ids=[1, 2, 3], start_s=2.0)
    assert turn.token_times_s() == pytest.approx([2.5, 2.6, 2.85])


def test_the_timeline_lists_requests_in_submission_order_with_their_first_and_last_token():
    result = SystemResult("x", wall_s=4.0)
    result.turns[(1, 0)] = Turn(0.5, [0.1, 0.1], [7, 8, 9], start_s=1.0)
    result.turns[(0, 0)] = Turn(1.0, [0.2], [5, 6], start_s=0.0)
    result.turns[(0, 1)] = Turn(0.25, [], [4], start_s=2.0)
    timeline = result.row(None)["timeline"]
    assert [(r["user"], r["turn"]) for r in timeline] == [(0, 0), (1, 0), (0, 1)]
    assert [(r["start_s"], r["first_token_s"], r["end_s"]) for r in timeline] == [
        (0.0, 1.0, 1.2), (1.0, 1.5, 1.7), (2.0, 2.25, 2.25)]
    assert timeline[1]["itl_s"] == [0.1, 0.1]


def test_a_clock_given_the_run_start_says_when_its_turn_was_submitted():
    t0 = time.perf_counter() - 3.0  # the run began three seconds ago
    clock = TurnClock()
    clock.tick()
    turn = clock.turn([1], t0)
    assert 2.9 < turn.start_s < 3.5
    assert turn.token_times_s()[0] == pytest.approx(turn.start_s + turn.ttft_s)


def test_the_timeline_plot_draws_every_system(tmp_path):
    rows = []
    for name, stall in (("a", 0.1), ("b", 0.9)):
        result = SystemResult(name, wall_s=3.0)
        result.turns[(0, 0)] = Turn(0.5, [0.1, stall, 0.1], [1, 2, 3, 4], start_s=0.0)
        rows.append(result.row(None))
    path = tmp_path / "timeline.png"
    plot_timeline(rows, path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
