import threading

from kvtier.tiers.health import Backoff, TierHealth


def test_back_off_doubles_while_probes_fail_and_is_capped():
    health = TierHealth("pool", Backoff(start_s=1.0, max_s=8.0, stable_s=60.0))
    assert health.healthy and health.backoff_s == 0.0 and health.state == "up"
    health.fail("connection refused")
    waits = [health.backoff_s]
    for _ in range(4):
        health.probe_failed()
        waits.append(health.backoff_s)
    assert waits == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert health.state == "down" and health.num_transitions == 1


def test_a_quick_relapse_keeps_the_back_off_growing_a_stable_tier_starts_afresh():
    health = TierHealth("ssd", Backoff(start_s=1.0, max_s=30.0, stable_s=60.0))
    health.fail("ENOSPC", reads=False)
    health.probe_failed()  # 2 s
    health.recover()
    assert health.healthy and health.backoff_s == 0.0
    health.fail("ENOSPC", reads=False)  # again at once: flapping
    assert health.backoff_s == 4.0 and health.state == "read-only"
    health.backoff = Backoff(start_s=1.0, max_s=30.0, stable_s=0.0)  # as if up for long enough
    health.recover()
    health.fail("ENOSPC", reads=False)
    assert health.backoff_s == 1.0 and health.num_transitions == 5


def test_fail_is_idempotent_narrows_and_wakes_watchers():
    health = TierHealth("ssd")
    woken = threading.Event()
    health.watch(woken)
    health.fail("EROFS", reads=False)
    assert woken.is_set() and (health.readable, health.writable) == (True, False)
    woken.clear()
    health.fail("EROFS again", reads=False)  # no change: no transition, no wake-up
    assert not woken.is_set() and health.num_transitions == 1 and health.reason.startswith("EROFS")
    retry_at = health.retry_at
    health.fail("get raised RuntimeError")  # now both ways; the outage (and its clock) goes on
    assert health.state == "down" and health.retry_at == retry_at and health.num_transitions == 2
    assert woken.is_set()
    woken.clear()
    health.unwatch(woken)
    health.recover()
    health.fail("again")
    assert not woken.is_set()
    assert health.retry_due(health.retry_at) and not health.retry_due(health.retry_at - 0.001)
