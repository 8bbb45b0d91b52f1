"""Tier health in /metrics and the dashboard data, read at scrape time from the tiers' `health`."""

import errno
import os

import torch

from kvtier.codecs import get_codec
from kvtier.tiers.manager import TierManager
from kvtier.server.metrics import EngineView, ServerMetrics
from kvtier.tiers import Backoff, DiskTier, HostTier

BLOCK = get_codec("raw").encode(torch.zeros((1, 2, 1, 4, 4)), bytes(16))


def _values(text: str, tier: str) -> dict[str, float]:
    suffix = f'{{tier="{tier}"}}'
    return {line.split(suffix)[0]: float(line.split()[-1]) for line in text.splitlines() if suffix in line}


def test_a_full_disk_shows_as_readable_not_writable(tmp_path, monkeypatch):
    m = TierManager([HostTier(4 * len(BLOCK), len(BLOCK)), DiskTier(tmp_path, 1 << 20)], async_writes=False,
                    backoff=Backoff(start_s=60.0, max_s=60.0))  # no probe during the test
    metrics = ServerMetrics(EngineView, manager=m)

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(DiskTier, "_write", staticmethod(full))
    m.put_many([(b"k" * 16, BLOCK)])
    ssd, dram = _values(metrics.render().decode(), "ssd"), _values(metrics.render().decode(), "dram")
    assert (ssd["kvtier_tier_readable"], ssd["kvtier_tier_writable"], ssd["kvtier_tier_healthy"]) == (1.0, 0.0, 0.0)
    assert ssd["kvtier_tier_backoff_seconds"] == 60.0 and ssd["kvtier_tier_health_transitions_total"] == 1.0
    assert (dram["kvtier_tier_healthy"], dram["kvtier_tier_backoff_seconds"]) == (1.0, 0.0)
    row = metrics.snapshot()["tiers"][1]
    assert (row["name"], row["readable"], row["writable"], row["healthy"]) == ("ssd", True, False, False)
    m.close()
