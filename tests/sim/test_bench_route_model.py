"""`kvtier simulate`'s router models against a recorded `kvtier bench route` run (`data/bench_route/`: each
system's requests in the order and at the times that run sent them, and what it measured): the predicted
prefix-hit rate is within 10% of the measured one for round-robin (given the run's order), SGLang's
cache-aware router and every policy over the shared pool.

Dynamo on local tiers is not predictable to 10% at this size: where it sends a conversation's next turn
turns on its load terms (the prefill booked on a replica, its running requests' blocks), one moved turn of
15 changes the rate by 7-10 points, and the model's prediction swings between 32% and 53% over the measured
prefill and decode speeds +-15% (the measured rate itself was 41%, 42%, 52% and 60% in four runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.route import simulate

DATA = Path(__file__).parent / "data" / "bench_route"
RUN = json.loads((DATA / "measured.json").read_text())
LOAD_SENSITIVE = {"dynamo/local"}


def _predicted(system: str) -> float:
    measured = RUN["systems"][system]
    policy, setup = system.split("/")
    return simulate(DATA / f"{policy}-{setup}.jsonl", policy, setup, device_blocks=RUN["device_blocks"],
                    prefill_tokens_per_s=measured["prefill_tokens_per_s"],
                    decode_s_per_token=measured["itl_mean_s"])["prefix_hit_rate"]


@pytest.mark.parametrize("system", sorted(set(RUN["systems"]) - LOAD_SENSITIVE))
def test_the_router_model_predicts_the_measured_prefix_hit_rate_within_10_percent(system):
    assert _predicted(system) == pytest.approx(RUN["systems"][system]["prefix_hit_rate"], rel=0.10)


@pytest.mark.xfail(strict=True, reason="Dynamo's load-driven moves are not predictable to 10% on 15 requests "
                                       "(see the module docstring); strict: a model that gets there says so")
def test_the_dynamo_model_on_local_tiers_within_10_percent():
    assert _predicted("dynamo/local") == pytest.approx(RUN["systems"]["dynamo/local"]["prefix_hit_rate"], rel=0.10)
