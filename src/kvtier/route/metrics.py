"""The router's Prometheus metrics, on a registry of its own (one per app: no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class RouteMetrics:
    def __init__(self, replica_names: list[str]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvtier_route_requests", "requests answered, by the replica that answered, the "
                                "policy that chose it and the status passed through",
                                ["replica", "policy", "code"], registry=r)
        self.prompt_tokens = Counter("kvtier_route_prompt_tokens", "prompt tokens, as the replicas' usage says",
                                     ["replica", "policy"], registry=r)
        self.cached_tokens = Counter("kvtier_route_cached_tokens", "prompt tokens the replica did not compute "
                                     "(usage.prompt_tokens_details.cached_tokens)", ["replica", "policy"], registry=r)
        self.matched_tokens = Counter("kvtier_route_selector_matched_tokens", "prompt tokens the selector found "
                                      "cached on the replica it chose: gpu (device), cpu (device + host), "
                                      "disk (every tier)", ["replica", "policy", "tier"], registry=r)
        self.retries = Counter("kvtier_route_retries", "requests sent elsewhere after a replica failed them",
                               ["replica", "reason"], registry=r)
        self.fallbacks = Counter("kvtier_route_selector_fallbacks", "requests least-loaded chose because the "
                                 "selector did not answer", registry=r)
        self.in_flight = Gauge("kvtier_route_in_flight", "requests in flight per replica", ["replica"], registry=r)
        self.up = Gauge("kvtier_route_replica_up", "1 in service, 0 taken out", ["replica"], registry=r)
        for name in replica_names:
            self.up.labels(name).set(1)
            self.in_flight.labels(name).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
