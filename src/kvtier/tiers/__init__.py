"""Storage tiers below the device: host DRAM and local SSD (Mooncake and Redis pools: planned)."""

from __future__ import annotations

from pathlib import Path

from kvtier.errors import UserError
from kvtier.tiers.base import Tier, TierStats
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.host import HostTier
from kvtier.units import parse_bytes


def make_tier(spec: str, *, slot_bytes: int) -> Tier:
    """`dram:1GiB` or `ssd:/path:10GiB`."""
    kind, _, rest = spec.partition(":")
    if kind == "dram":
        return HostTier(parse_bytes(rest or "1GiB"), slot_bytes)
    if kind == "ssd":
        path, _, size = rest.rpartition(":")
        if not path:
            raise UserError(f"ssd tier spec needs a directory and a size: ssd:/path:10GiB, got {spec!r}")
        return DiskTier(Path(path), parse_bytes(size))
    raise UserError(f"unknown or not yet implemented tier {spec!r}: available dram:SIZE, ssd:DIR:SIZE")


__all__ = ["DiskTier", "HostTier", "Tier", "TierStats", "make_tier"]
