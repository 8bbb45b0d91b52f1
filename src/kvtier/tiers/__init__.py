"""Storage tiers below the device: host DRAM, the pooled memory tier (Mooncake Store or Redis), local SSD."""

from __future__ import annotations

from kvtier.tiers.base import Tier, TierStats
from kvtier.tiers.disk import DiskTier, SharedMemoryTier
from kvtier.tiers.health import Backoff, TierHealth
from kvtier.tiers.host import HostTier
from kvtier.tiers.spec import TierSpec


def make_tier(spec: str | TierSpec, *, slot_bytes: int) -> Tier:
    """The tier a spec names (`TierSpec.parse`: `dram:1GiB`, `ssd:/path:10GiB`, `shm:/dev/shm/dir:1GiB`,
    `mooncake://HOST:PORT[?options]`, `redis://HOST:PORT/DB`)."""
    spec = TierSpec.parse(spec)
    if spec.kind == "dram":
        return HostTier(spec.capacity_bytes, slot_bytes)
    if spec.kind in ("ssd", "shm"):
        return (DiskTier if spec.kind == "ssd" else SharedMemoryTier)(spec.path, spec.capacity_bytes)
    if spec.kind == "mooncake":
        from kvtier.tiers.mooncake import mooncake_tier

        return mooncake_tier(spec)
    from kvtier.tiers.redis import redis_tier

    return redis_tier(spec.url)


__all__ = ["Backoff", "DiskTier", "HostTier", "SharedMemoryTier", "Tier", "TierHealth", "TierSpec", "TierStats", "make_tier"]
