"""What lands in and leaves each tier, for a caller that reports it (the vLLM connector's KV events).

One mechanism: `TierManager.watch()` hands every tier of its stack one `TierEvents` log; a tier appends
to it where a block lands (a write that went through) and where one leaves (evicted, deleted as bad,
found gone), through `announce_stored` / `announce_removed`, and whoever watches drains it with
`take()`. A tier never calls anything above it: the log is a list behind a lock. A stack nobody watches
has no log (`Tier.events is None`) and pays one attribute check per write.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierEvent:
    """`keys` landed in (`stored`) or left (not `stored`) the tier named `tier`, in this order."""

    tier: str
    stored: bool
    keys: tuple[bytes, ...]


class TierEvents:
    """An append-only log, appended from any thread (the tiers' readers and writers), drained by one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[TierEvent] = []

    def append(self, tier: str, stored: bool, keys) -> None:
        if keys:
            with self._lock:
                self._events.append(TierEvent(tier, stored, tuple(keys)))

    def take(self) -> list[TierEvent]:
        """Every event since the last `take`, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events


def announce_stored(tier, keys) -> None:
    """`keys` were written into `tier` (a block already there is not announced again)."""
    if tier.events is not None:
        tier.events.append(tier.name, True, keys)


def announce_removed(tier, keys) -> None:
    """`keys` left `tier`: evicted, deleted as corrupt, or found gone (another process, a pool's eviction)."""
    if tier.events is not None:
        tier.events.append(tier.name, False, keys)
