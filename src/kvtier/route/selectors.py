"""Which replica takes a request: `round-robin`, `least-loaded`, and `dynamo` (NVIDIA Dynamo's selection service).

A selector gets the prompt's token ids (None when the router could not tokenize the body: the replica
will answer it, usually with its 400) and the replicas in service, and returns a `Choice`. Only the
dynamo selector can fail (`SelectorError`); the app then asks least-loaded.

Dynamo: `python -m dynamo.select_service` (PyPI `ai-dynamo-runtime` 1.6.1, no NATS or etcd) keeps a KV
index per worker fed by each replica's KV events (it subscribes to the ZMQ publishers given at `POST
/workers`) and scores workers by cached prefix, weighted per tier (device, host, disk), against their
load, which it books per request: `POST /select` (query only, cached under a selection id), then `POST
/reservations` (book it on the worker the router really sends to), `POST
/reservations/{id}/prefill_complete` at the reply's first bytes and `DELETE /reservations/{id}` at its end.
Its answer says what it matched per tier: `overlap` `gpu` (device), `cpu` (device + host), `disk` (all
tiers), in tokens.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from kvtier.route.replicas import Replica

log = logging.getLogger("kvtier.route")

POLICIES = ("round-robin", "least-loaded", "dynamo")


@dataclass(slots=True)
class Choice:
    replica: Replica
    matched_tokens: dict[str, int] = field(default_factory=dict)  # the selector's view: tier -> tokens
    reservation_id: str | None = None  # dynamo: booked load to release when the request ends
    policy: str = ""  # the policy that chose, where not the selector's own (dynamo asking least-loaded)


class SelectorError(Exception):
    """The selector could not answer (down, not ready, refused the query)."""


class Selector(Protocol):
    policy: str

    async def start(self) -> None: ...

    async def choose(self, token_ids: list[int] | None, candidates: list[Replica], *,
                     cache_salt: str | None = None) -> Choice: ...

    async def first_bytes(self, choice: Choice) -> None: ...

    async def finished(self, choice: Choice) -> None: ...

    async def close(self) -> None: ...


class _Stateless:
    async def start(self) -> None:
        pass

    async def first_bytes(self, choice: Choice) -> None:
        pass

    async def finished(self, choice: Choice) -> None:
        pass

    async def close(self) -> None:
        pass


class RoundRobin(_Stateless):
    """Replicas in their order, one request each; a replica taken out is skipped."""

    policy = "round-robin"

    def __init__(self, replicas: list[Replica]) -> None:
        self._cycle = itertools.cycle(replicas)
        self._num_replicas = len(replicas)

    async def choose(self, token_ids: list[int] | None, candidates: list[Replica], *,
                     cache_salt: str | None = None) -> Choice:
        wanted = {r.replica_id for r in candidates}
        for replica in itertools.islice(self._cycle, self._num_replicas):
            if replica.replica_id in wanted:
                return Choice(replica)
        raise AssertionError("no candidate among the replicas")


class LeastLoaded(_Stateless):
    """The replica with the fewest requests in flight (through this router); ties go to the one that
    was sent the fewest requests, then to the first."""

    policy = "least-loaded"

    async def choose(self, token_ids: list[int] | None, candidates: list[Replica], *,
                     cache_salt: str | None = None) -> Choice:
        return Choice(min(candidates, key=lambda r: (r.num_in_flight, r.num_requests, r.replica_id)))


class DynamoSelector:
    """NVIDIA Dynamo's selection service at `url` chooses; each replica is registered there as worker
    `replica_id` with its KV event endpoint (`model_name`, `block_size` as the replicas serve them)."""

    policy = "dynamo"

    def __init__(self, url: str, replicas: list[Replica], *, model_name: str, block_size: int,
                 timeout_s: float = 5.0) -> None:
        self.replicas = replicas
        self.model_name = model_name
        self.block_size = block_size
        self.client = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s)
        self._registered = False
        self._least_loaded = LeastLoaded()
        # one selection at a time, booked before the next is asked: two requests arriving together would
        # otherwise both be scored against the same unbooked load and sent to the same worker
        self._booking = asyncio.Lock()

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            reply = await self.client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise SelectorError(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        if reply.status_code >= 300:
            raise SelectorError(f"{method} {path} answered {reply.status_code}: {reply.text[:200]}")
        return reply.json() if reply.content else {}

    async def register(self) -> None:
        """Every replica as a worker, subscribed to its KV events (an upsert: safe to repeat)."""
        for replica in self.replicas:
            worker = {"worker_id": replica.replica_id, "model_name": self.model_name, "endpoint": replica.url,
                      "block_size": self.block_size}
            if replica.kv_events_endpoint:
                worker["kv_events_endpoints"] = {"0": replica.kv_events_endpoint}
            if replica.kv_events_replay_endpoint:
                worker["replay_endpoint"] = replica.kv_events_replay_endpoint
            await self._call("POST", "/workers", worker)
        self._registered = True

    async def start(self) -> None:
        """Registers the replicas (their KV events flow into the index from then on); a selector not up yet
        is registered at the first request it answers."""
        try:
            await self.register()
        except SelectorError as exc:
            log.warning("kvtier route: the dynamo selector did not take the replicas yet (%s)", exc)

    async def choose(self, token_ids: list[int] | None, candidates: list[Replica], *,
                     cache_salt: str | None = None) -> Choice:
        if not token_ids:  # nothing to match: load alone decides
            return await self._by_load(candidates)
        if not self._registered:
            await self.register()
        selection_id = uuid.uuid4().hex
        async with self._booking:
            query = {"model_name": self.model_name, "token_ids": token_ids, "selection_id": selection_id}
            if cache_salt is not None:  # a tenant's blocks match under its salt only (the replicas' events name it)
                query["cache_salt"] = cache_salt
            picked = await self._call("POST", "/select", query)
            overlap = picked.get("overlap") or {}
            matched = {tier: int(overlap.get(tier) or 0) for tier in ("gpu", "cpu", "disk")}
            by_id = {r.replica_id: r for r in candidates}
            replica = by_id.get(picked.get("worker_id"))
            if replica is None:  # it chose a replica taken out: the load decides among the others, nothing booked
                return await self._by_load(candidates)
            await self._call("POST", "/reservations", {"selection_id": selection_id,
                                                       "model_name": self.model_name})
        return Choice(replica, matched, selection_id)

    async def _by_load(self, candidates: list[Replica]) -> Choice:
        choice = await self._least_loaded.choose(None, candidates)
        choice.policy = self._least_loaded.policy
        return choice

    async def first_bytes(self, choice: Choice) -> None:
        if choice.reservation_id is not None:
            await self._quiet("POST", f"/reservations/{choice.reservation_id}/prefill_complete")

    async def finished(self, choice: Choice) -> None:
        if choice.reservation_id is not None:
            await self._quiet("DELETE", f"/reservations/{choice.reservation_id}")

    async def _quiet(self, method: str, path: str) -> None:
        try:  # bookkeeping only: the selector expires stale reservations itself
            await self._call(method, path)
        except SelectorError:
            pass

    async def close(self) -> None:
        await self.client.aclose()


def make_selector(policy: str, replicas: list[Replica], *, selector_url: str | None = None,
                  model_name: str = "", block_size: int = 0) -> Selector:
    if policy == "round-robin":
        return RoundRobin(replicas)
    if policy == "least-loaded":
        return LeastLoaded()
    if policy == "dynamo":
        if not selector_url:
            raise ValueError("the dynamo policy needs --selector URL (python -m dynamo.select_service)")
        return DynamoSelector(selector_url, replicas, model_name=model_name, block_size=block_size)
    raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
