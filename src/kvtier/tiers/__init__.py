"""Storage tiers below the device: host DRAM, the pooled memory tier (Mooncake Store or Redis), local SSD."""

from __future__ import annotations

from pathlib import Path

from kvtier.errors import UserError
from kvtier.tiers.base import Tier, TierStats
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.health import Backoff, TierHealth
from kvtier.tiers.host import HostTier
from kvtier.units import parse_bytes


def make_tier(spec: str, *, slot_bytes: int) -> Tier:
    """`dram:1GiB`, `ssd:/path:10GiB`, `mooncake://HOST:PORT[?options]`, `redis://HOST:PORT/DB`."""
    kind, _, rest = spec.partition(":")
    if kind == "dram":
        return HostTier(parse_bytes(rest or "1GiB"), slot_bytes)
    if kind == "ssd":
        path, _, size = rest.rpartition(":")
        if not path:
            raise UserError(f"ssd tier spec needs a directory and a size: ssd:/path:10GiB, got {spec!r}")
        return DiskTier(Path(path), parse_bytes(size))
    if kind == "mooncake":
        from kvtier.tiers.mooncake import mooncake_tier

        return mooncake_tier(spec)
    if kind in ("redis", "rediss", "unix"):
        from kvtier.tiers.redis import redis_tier

        return redis_tier(spec)
    raise UserError(f"unknown tier {spec!r}: use dram:SIZE, ssd:DIR:SIZE, mooncake://HOST:PORT, redis://HOST:PORT/DB")


__all__ = ["Backoff", "DiskTier", "HostTier", "Tier", "TierHealth", "TierStats", "make_tier"]
