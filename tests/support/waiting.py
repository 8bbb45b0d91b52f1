"""Polling for what another process or thread makes true (a relayed event, a service's index)."""

from __future__ import annotations

import time


def wait_until(fetch, ok, what: str, timeout_s: float, poll_s: float = 0.1):
    """`fetch()` until `ok` of it holds (returned) or `timeout_s` passes (a failed assert naming `what` and the last
    value)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = fetch()
        if ok(got) or time.monotonic() > deadline:
            assert ok(got), f"{what}: {got}"
            return got
        time.sleep(poll_s)
