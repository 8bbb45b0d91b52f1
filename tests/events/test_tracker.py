"""`KvEventTracker` (no vLLM): tier events on kvtier keys become vLLM-style block records under vLLM's
block hashes, one announcement per medium (the vLLM connector's and `kvtier serve`'s KV events)."""

from kvtier.events.tracker import BlockInfo, KvEventTracker, Removed, Stored, medium_of
from kvtier.tiers.events import TierEvent

K = [bytes([i]) * 16 for i in range(6)]
INFO = [BlockInfo(block_hash=100 + i, parent_hash=100 + i - 1 if i else None, token_ids=tuple(range(4 * i, 4 * i + 4)),
                  extra_keys=("tenant-a",) if i == 0 else None) for i in range(6)]


def _tracker(n: int = 3) -> KvEventTracker:
    tracker = KvEventTracker()
    tracker.describe(K[:n], INFO[:n])
    return tracker


def test_mediums_are_what_vllm_and_dynamo_read():
    assert [medium_of(t) for t in ("dram", "shm", "ssd", "ssd2", "mooncake", "redis")] == \
        ["CPU", "CPU", "STORAGE", "STORAGE", "SHARED", "SHARED"]


def test_a_stored_block_is_announced_once_per_medium_and_removed_with_the_last_tier_of_it():
    tracker = _tracker()
    tracker.apply([TierEvent("dram", True, (K[0], K[1])), TierEvent("shm", True, (K[0],)),
                   TierEvent("ssd", True, (K[0],))])
    assert tracker.take() == [Stored(INFO[0], "CPU"), Stored(INFO[1], "CPU"), Stored(INFO[0], "STORAGE")]
    tracker.apply([TierEvent("dram", False, (K[0], K[1]))])
    assert tracker.take() == [Removed((101,), "CPU")]  # K[0] is still in shm: CPU holds it
    tracker.apply([TierEvent("shm", False, (K[0],)), TierEvent("ssd", False, (K[0],))])
    assert tracker.take() == [Removed((100,), "CPU"), Removed((100,), "STORAGE")]
    assert tracker.num_held() == 0


def test_removals_in_a_row_are_one_record_and_unknown_keys_are_not_ours():
    tracker = _tracker()
    tracker.apply([TierEvent("ssd", True, K[:3]), TierEvent("ssd", True, (K[5],)),
                   TierEvent("ssd", False, (K[4],))])
    assert tracker.take() == [Stored(INFO[0], "STORAGE"), Stored(INFO[1], "STORAGE"), Stored(INFO[2], "STORAGE")]
    tracker.apply([TierEvent("ssd", False, (K[0],)), TierEvent("ssd", False, (K[1], K[2]))])
    assert tracker.take() == [Removed((100, 101, 102), "STORAGE")]


def test_a_block_gone_from_every_tier_is_announced_again_when_a_write_of_it_lands_later():
    tracker = _tracker(1)
    # shm let it go before the SSD's write-through of it landed (both queued on the same save)
    tracker.apply([TierEvent("shm", True, (K[0],)), TierEvent("shm", False, (K[0],)),
                   TierEvent("ssd", True, (K[0],))])
    assert tracker.take() == [Stored(INFO[0], "CPU"), Removed((100,), "CPU"), Stored(INFO[0], "STORAGE")]
    assert tracker.num_held("STORAGE") == 1 and tracker.num_held("CPU") == 0


def test_a_lookup_announces_blocks_found_where_this_process_never_wrote_them():
    tracker = _tracker(2)
    tracker.found(K[:2], ["ssd", "mooncake"])
    tracker.found(K[:1], ["ssd"])  # again: already announced
    assert tracker.take() == [Stored(INFO[0], "STORAGE"), Stored(INFO[1], "SHARED")]


def test_described_blocks_no_tier_took_are_forgotten_oldest_first(monkeypatch):
    import kvtier.events.tracker as events

    monkeypatch.setattr(events, "MAX_UNHELD_BLOCKS", 2)
    tracker = _tracker(3)
    tracker.apply([TierEvent("ssd", True, K[:3])])
    assert tracker.take() == [Stored(INFO[1], "STORAGE"), Stored(INFO[2], "STORAGE")]

