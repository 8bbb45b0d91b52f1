"""A tier's health: whether it can be read, whether it can be written, and when to probe it again.

Two states, not one: a full or read-only disk still serves what it holds (readable, not writable);
a dead pool serves nothing (neither). Each tier owns one `TierHealth` and turns a side off with
`fail()` when an I/O error says so; the manager turns both off when a tier raises. `reconnect()`
probes and calls `recover()` on success. The manager's retry thread asks `retry_due()` and reports
a failed probe with `probe_failed()`, which doubles the wait up to `Backoff.max_s`.

No flapping: a recovery does not reset the back-off. A tier that fails again within
`Backoff.stable_s` of coming back (a nearly full disk that takes one more block, a pool that
restarts in a loop) starts its next outage at twice the last wait; only a tier that stayed up that
long starts again at `start_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from kvtier.thread_names import named_thread

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Backoff:
    start_s: float = 1.0
    max_s: float = 30.0
    stable_s: float = 60.0  # up this long: the next outage starts at start_s again

    def __post_init__(self) -> None:
        if not 0 < self.start_s <= self.max_s or self.stable_s < 0:
            raise ValueError(f"back-off needs 0 < start_s <= max_s and stable_s >= 0, got {self}")

    def after(self, delay_s: float) -> float:
        """The wait that follows a wait of `delay_s` (0: none yet)."""
        return min(max(2 * delay_s, self.start_s), self.max_s)


class TierHealth:
    """Readable / writable state of one tier, its transitions and its retry back-off. Thread-safe:
    the read side, the write side and the retry thread all report here."""

    def __init__(self, name: str, backoff: Backoff | None = None) -> None:
        self.name = name
        self.backoff = backoff or Backoff()
        self.readable = True
        self.writable = True
        self.reason = ""               # why the tier is (partly) down; "" while up
        self.num_transitions = 0       # state changes: a flapping tier shows here
        self.retry_at = 0.0            # time.monotonic() of the next probe, while down
        self._delay_s = 0.0            # the current wait while down; the last one while up
        self._up_since = time.monotonic()
        self._lock = threading.Lock()
        self._watchers: list[threading.Event] = []  # set on every outage (the manager's retry thread waits on one)

    def watch(self, event: threading.Event) -> None:
        self._watchers.append(event)

    def unwatch(self, event: threading.Event) -> None:
        if event in self._watchers:
            self._watchers.remove(event)

    @property
    def healthy(self) -> bool:
        return self.readable and self.writable

    @property
    def backoff_s(self) -> float:
        """The wait before the next probe; 0 while the tier is up."""
        return 0.0 if self.healthy else self._delay_s

    @property
    def state(self) -> str:
        return "up" if self.healthy else "read-only" if self.readable else "write-only" if self.writable else "down"

    def fail(self, reason: str, *, reads: bool = True, writes: bool = True) -> None:
        """Turn reads and/or writes off (a full disk: `reads=False`). Idempotent; logs each transition once."""
        with self._lock:
            readable, writable = self.readable and not reads, self.writable and not writes
            if (readable, writable) == (self.readable, self.writable):
                return
            now = time.monotonic()
            if self.healthy:  # an outage starts: how long until the first probe
                flapping = self._delay_s > 0 and now - self._up_since < self.backoff.stable_s
                self._delay_s = self.backoff.after(self._delay_s) if flapping else self.backoff.start_s
                self.retry_at = now + self._delay_s
            self.readable, self.writable, self.reason = readable, writable, reason
            self.num_transitions += 1
            delay_s = self._delay_s
        for event in self._watchers:
            event.set()
        log.warning("%s tier: %s; %s until a probe succeeds (next in %.1f s)", self.name, reason,
                    "writes off, reads go on" if readable else "reads and writes off", delay_s)

    def recover(self) -> None:
        """Both sides on again (a probe succeeded). The back-off is kept until the tier has stayed up."""
        with self._lock:
            if self.healthy:
                return
            self.readable = self.writable = True
            self.reason = ""
            self.num_transitions += 1
            self._up_since = time.monotonic()
        log.warning("%s tier: readable and writable again", self.name)

    def probe_failed(self) -> None:
        with self._lock:
            self._delay_s = self.backoff.after(self._delay_s)
            self.retry_at = time.monotonic() + self._delay_s

    def retry_due(self, now: float) -> bool:
        return not self.healthy and now >= self.retry_at


class HealthProber:
    """The one retry thread of a tier stack (`kvtier-retry`): sleeps until the next probe is due
    (woken by any outage) and probes each tier that is down (`reconnect()`) holding the lock of each
    side that is down, so the probe may rebuild what that side uses; a failed probe doubles the wait.
    Retries run whether or not requests arrive. `locks(tier) -> (read lock, write lock)`."""

    def __init__(self, tiers: list, locks) -> None:
        self.tiers = tiers
        self._locks = locks
        self._closed = False
        self._wake = threading.Event()  # set by an outage (TierHealth.watch) and by close()
        for tier in tiers:
            tier.health.watch(self._wake)
        self._thread = named_thread(self._loop, "kvtier-retry")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._wake.wait(self._wait_s())
            self._wake.clear()
            for tier in self.tiers:
                if self._closed:
                    return
                if tier.health.retry_due(time.monotonic()):
                    self.probe(tier)

    def _wait_s(self) -> float | None:
        """Until the next probe is due; None (until woken) while every tier is up."""
        now = time.monotonic()
        due = [tier.health.retry_at - now for tier in self.tiers if not tier.health.healthy]
        return max(0.0, min(due)) if due else None

    def probe(self, tier) -> None:
        health = tier.health
        read_lock, write_lock = self._locks(tier)
        with ExitStack() as held:  # the lock of each side that is down: reconnect() may rebuild it
            if not health.readable:
                held.enter_context(read_lock)
            held.enter_context(write_lock)
            try:
                tier.reconnect()  # on success the tier calls health.recover()
            except Exception:  # noqa: BLE001 - a tier's probe must not kill the retry thread
                log.exception("%s tier: reconnect raised", tier.name)
        if not health.healthy:
            health.probe_failed()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)  # a probe in flight ends within the backend's timeouts
        for tier in self.tiers:
            tier.health.unwatch(self._wake)
