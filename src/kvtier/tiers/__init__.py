"""Storage tiers below the device: host DRAM, the pooled memory tier (Mooncake Store or Redis), local SSD."""

from __future__ import annotations

from pathlib import Path

from kvtier.errors import UserError
from kvtier.tiers.base import Tier, TierStats
from kvtier.tiers.disk import DiskTier, SharedMemoryTier
from kvtier.tiers.health import Backoff, TierHealth
from kvtier.tiers.host import HostTier
from kvtier.units import parse_bytes


def make_tier(spec: str, *, slot_bytes: int) -> Tier:
    """`dram:1GiB`, `ssd:/path:10GiB`, `shm:/dev/shm/dir:1GiB`, `mooncake://HOST:PORT[?options]`, `redis://HOST:PORT/DB`."""
    kind, _, rest = spec.partition(":")
    if kind == "dram":
        return HostTier(parse_bytes(rest or "1GiB"), slot_bytes)
    if kind in ("ssd", "shm"):
        path, _, size = rest.rpartition(":")
        if not path:
            raise UserError(f"{kind} tier spec needs a directory and a size: {kind}:/path:10GiB, got {spec!r}")
        return (DiskTier if kind == "ssd" else SharedMemoryTier)(Path(path), parse_bytes(size))
    if kind == "mooncake":
        from kvtier.tiers.mooncake import mooncake_tier

        return mooncake_tier(spec)
    if kind in ("redis", "rediss", "unix"):
        from kvtier.tiers.redis import redis_tier

        return redis_tier(spec)
    raise UserError(f"unknown tier {spec!r}: use dram:SIZE, ssd:DIR:SIZE, shm:DIR:SIZE, mooncake://HOST:PORT, redis://HOST:PORT/DB")


__all__ = ["Backoff", "DiskTier", "HostTier", "SharedMemoryTier", "Tier", "TierHealth", "TierStats", "make_tier"]
