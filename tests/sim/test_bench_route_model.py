"""`kvtier simulate`'s router models against recorded `kvtier bench route` runs (each system's requests in the
order and at the times that run sent them, and what it measured; `data/bench_route/`: 5 users x 3 turns on
20-block replicas, `data/bench_route_6turns/`: 5 users x 6 turns on 26-block replicas, with Dynamo at
prefill_load_scale 1 and 4): the predicted prefix-hit rate is within 10% of the measured one for round-robin
(given the run's order), SGLang's cache-aware router, Dynamo at prefill_load_scale 4 (`dynamo:4`, which
keeps every conversation on its replica) and every policy over the shared pool. With each replica's `shm:`
tier bounded (`--tier-blocks 100`, so kvtier evicts: `data/bench_route_bounded_tier/`, 8 users x 10 turns, and
`data/bench_route_shared_prefix/`, the same with a 500-character prefix every user shares, which sends every
conversation to one replica under SGLang's router) the model takes the tier's blocks root first, as kvtier's
connector admitted them when every recorded run was measured (`"root_first_tiers": true` in each
`measured.json`; `ClusterConfig.root_first_tiers`); tail first it predicted 53-55% for SGLang's overloaded
replica where 43-44% was measured. kvtier's tiers now refresh a request's blocks tail first, and `bench route`
simulates them so.

Dynamo on local tiers at its default prefill_load_scale (1) is not predictable to 10% at this size (6-turn
run: 60% predicted, 69% measured; bounded-tier run: 68% vs 77%, 9 turns moved; within 10% only in the
shared-prefix run, 80% vs 85%): where it sends a conversation's next turn
turns on its load terms (the prefill booked on a replica, its running requests' blocks), one moved turn of
15 changes the rate by 7-10 points, and the model's prediction swings between 32% and 53% over the measured
prefill and decode speeds +-15% (the measured rate itself was 41%, 42%, 52% and 60% in four runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.bench.route import simulate

DATA = Path(__file__).parent / "data"
RUNS = {name: json.loads((DATA / name / "measured.json").read_text())
        for name in ("bench_route", "bench_route_6turns", "bench_route_bounded_tier", "bench_route_shared_prefix")}
# Dynamo at prefill_load_scale 1 where the model moves turns the service did not (9 moved in the bounded-tier run)
LOAD_SENSITIVE = {(run, "dynamo/local") for run in ("bench_route", "bench_route_6turns", "bench_route_bounded_tier")}


def _predicted(run: str, system: str) -> float:
    recorded = RUNS[run]
    measured = recorded["systems"][system]
    policy, setup = system.split("/")
    trace = DATA / run / f"{policy.replace(':', '_')}-{setup}.jsonl"
    return simulate(trace, policy, setup, device_blocks=recorded["device_blocks"],
                    prefill_tokens_per_s=measured["prefill_tokens_per_s"],
                    decode_s_per_token=measured["itl_mean_s"],
                    tier_blocks=recorded.get("tier_blocks", 0),
                    root_first_tiers=recorded["root_first_tiers"])["prefix_hit_rate"]


@pytest.mark.parametrize("run, system", [(run, system) for run in RUNS for system in sorted(RUNS[run]["systems"])
                                         if (run, system) not in LOAD_SENSITIVE])
def test_the_router_model_predicts_the_measured_prefix_hit_rate_within_10_percent(run, system):
    assert _predicted(run, system) == pytest.approx(RUNS[run]["systems"][system]["prefix_hit_rate"], rel=0.10)


@pytest.mark.xfail(strict=True, reason="Dynamo's load-driven moves at its default prefill_load_scale are not "
                                       "predictable to 10% on 15 to 80 requests (see the module docstring); "
                                       "strict: a model that gets there says so")
@pytest.mark.parametrize("run", sorted(run for run, _ in LOAD_SENSITIVE))
def test_the_dynamo_model_on_local_tiers_within_10_percent(run):
    measured = RUNS[run]["systems"]["dynamo/local"]["prefix_hit_rate"]
    assert _predicted(run, "dynamo/local") == pytest.approx(measured, rel=0.10)



@pytest.mark.parametrize("run, system", [("bench_route_shared_prefix", "sglang/local"),
                                         ("bench_route_bounded_tier", "round-robin/local")])
def test_bench_route_simulates_kvtier_s_tiers_tail_first(run, system):
    """The recorded runs' code took a bounded tier's blocks root first; kvtier's tiers now refresh them tail
    first, and `simulate` models that unless told otherwise: more prompts hit where the tier is under pressure
    (SGLang's overloaded replica: 53% vs 42% root first, 44% measured; round-robin in r8: 53% vs 45%, 49%)."""
    recorded = RUNS[run]
    measured = recorded["systems"][system]
    policy, setup = system.split("/")
    rates = [simulate(DATA / run / f"{policy}-{setup}.jsonl", policy, setup, device_blocks=recorded["device_blocks"],
                      prefill_tokens_per_s=measured["prefill_tokens_per_s"], decode_s_per_token=measured["itl_mean_s"],
                      tier_blocks=recorded["tier_blocks"], **root_first)["prefix_hit_rate"]
             for root_first in ({}, {"root_first_tiers": True})]
    assert rates[0] > rates[1] + 0.05, rates
