"""Storage tiers below the device: host DRAM, the pooled memory tier (Mooncake Store or Redis), local SSD.

The tier classes are imported on first use, so reading a tier spec (`kvtier serve --help`) needs no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvtier.tiers.spec import TierSpec

if TYPE_CHECKING:
    from kvtier.tiers.base import Tier

_HOME = {"Tier": "base", "TierStats": "base", "DiskTier": "disk", "DiskStore": "disk", "SharedMemoryTier": "disk",
         "Backoff": "health", "TierHealth": "health", "HostTier": "host"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvtier.tiers.{_HOME[name]}"), name)


def make_tier(spec: str | TierSpec, *, slot_bytes: int, owner: bool = True) -> Tier:
    """The tier a spec names (`TierSpec.parse`: `dram:1GiB`, `ssd:/path:10GiB`, `shm:/dev/shm/dir:1GiB`,
    `mooncake://HOST:PORT[?options]`, `redis://HOST:PORT/DB`). `owner=False`: a directory (ssd, shm)
    whose index and eviction another process keeps (`DiskStore`: a vLLM worker's)."""
    spec = TierSpec.parse(spec)
    if spec.kind == "dram":
        from kvtier.tiers.host import HostTier

        return HostTier(spec.capacity_bytes, slot_bytes)
    if spec.kind in ("ssd", "shm"):
        from kvtier.tiers.disk import DiskStore, DiskTier, SharedMemoryTier

        if not owner:
            return DiskStore(spec.path, name=spec.kind)
        return (DiskTier if spec.kind == "ssd" else SharedMemoryTier)(spec.path, spec.capacity_bytes)
    if spec.kind == "mooncake":
        from kvtier.tiers.mooncake import mooncake_tier

        return mooncake_tier(spec)
    from kvtier.tiers.redis import redis_tier

    return redis_tier(spec.url)


__all__ = ["Backoff", "DiskStore", "DiskTier", "HostTier", "SharedMemoryTier", "Tier", "TierHealth", "TierSpec",
           "TierStats", "make_tier"]
