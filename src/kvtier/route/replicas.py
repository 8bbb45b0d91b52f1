"""The router's replicas: where each one is, what it is doing now, and whether it is taken out.

A replica that refuses a connection or answers 5xx is taken out for a back-off (1 s, then doubled per
consecutive failure, at most `MAX_BACKOFF_S`); once its back-off has passed it is offered again, and the
next request sent to it is the retry: an answer below 500 brings it back in, a failure doubles the wait.
No probe traffic of its own, so a replica's state changes only with the requests it gets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


@dataclass(slots=True)
class Replica:
    """One OpenAI-compatible server (vLLM + kvtier, or `kvtier serve`) behind the router."""

    replica_id: int  # 1.. in the order given; the selector's worker id
    url: str
    kv_events_endpoint: str | None = None  # its `--kv-events-config` publisher (the dynamo policy subscribes)
    kv_events_replay_endpoint: str | None = None
    num_in_flight: int = 0
    num_requests: int = 0  # sent to it, retries included
    num_failures: int = 0  # consecutive
    out_until: float = 0.0  # monotonic; taken out while now < out_until

    @property
    def name(self) -> str:
        return self.url.removeprefix("http://").removeprefix("https://").rstrip("/")


class ReplicaSet:
    """The replicas, their in-flight counts and their back-offs. `clock` is injectable for tests."""

    def __init__(self, replicas: list[Replica], *, clock: Callable[[], float] = time.monotonic,
                 first_backoff_s: float = FIRST_BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S) -> None:
        assert replicas, "at least one replica"
        self.replicas = replicas
        self.clock = clock
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s

    def available(self, exclude: set[int] = frozenset()) -> list[Replica]:
        """Replicas in service (or whose back-off has passed), in order, without those in `exclude` (ids)."""
        now = self.clock()
        return [r for r in self.replicas if r.out_until <= now and r.replica_id not in exclude]

    def is_out(self, replica: Replica) -> bool:
        return replica.out_until > self.clock()

    def take_out(self, replica: Replica) -> float:
        """Out for a back-off doubling with each consecutive failure; returns the back-off in seconds."""
        backoff_s = min(self.first_backoff_s * 2 ** replica.num_failures, self.max_backoff_s)
        replica.num_failures += 1
        replica.out_until = self.clock() + backoff_s
        return backoff_s

    def succeeded(self, replica: Replica) -> bool:
        """A reply below 500: back in service. True when it had been taken out."""
        was_failing = replica.num_failures > 0
        replica.num_failures = 0
        replica.out_until = 0.0
        return was_failing
