"""Tier specs: `dram:1GiB`, `ssd:/path:10GiB`, `shm:/dev/shm/dir:1GiB`, `mooncake://HOST:PORT[?options]`,
`redis://HOST:PORT/DB`, parsed once into a `TierSpec` that every user of a spec reads (`make_tier`,
`kvtier generate`, the vLLM connector's config). No tier is built and nothing is connected here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from kvtier.errors import ConfigError
from kvtier.units import SizeError, parse_bytes

DEFAULT_DRAM = "1GiB"
MOONCAKE_OPTIONS = ("metadata", "segment", "buffer", "protocol", "device", "local")
_REDIS_SCHEMES = ("redis", "rediss", "unix")
USAGE = "dram:SIZE, ssd:DIR:SIZE, shm:DIR:SIZE, mooncake://HOST:PORT, redis://HOST:PORT/DB"


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One parsed tier spec. `text` is the spec as written (what `str()` gives back)."""

    kind: str                     # "dram", "ssd", "shm", "mooncake", "redis"
    text: str
    capacity_bytes: int | None    # None: the pool's service owns capacity and eviction
    path: Path | None = None      # ssd, shm: the block directory
    url: str | None = None        # pools: what the backend connects to (mooncake: the master's HOST:PORT)
    options: dict[str, str] = field(default_factory=dict, hash=False)  # mooncake: ?metadata=URL&segment=SIZE&...

    @property
    def shared(self) -> bool:
        """Seen by other processes: shm, SSD and pools; a dram tier is this process's own memory."""
        return self.kind != "dram"

    def __str__(self) -> str:
        return self.text

    @classmethod
    def parse(cls, spec: str | TierSpec) -> TierSpec:
        """The spec, checked; a bad one is a one-line `UserError` naming it."""
        if isinstance(spec, TierSpec):
            return spec
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"a tier spec must be a non-empty string ({USAGE}), got {spec!r}")
        kind, _, rest = spec.partition(":")
        parse = _PARSERS.get(kind)
        if parse is None:
            raise ConfigError(f"unknown tier {spec!r}: use {USAGE}")
        try:
            return parse(spec, rest)
        except SizeError as exc:
            raise ConfigError(f"tier spec {spec!r}: {exc}") from None


def _dram(spec: str, rest: str) -> TierSpec:
    return TierSpec("dram", spec, _positive_size(spec, rest or DEFAULT_DRAM))


def _disk(spec: str, rest: str) -> TierSpec:
    kind = spec.partition(":")[0]
    path, _, size = rest.rpartition(":")
    if not path or not size:
        raise ConfigError(f"{kind} tier spec needs a directory and a size: {kind}:/path:10GiB, got {spec!r}")
    return TierSpec(kind, spec, _positive_size(spec, size), path=Path(path))


def _mooncake(spec: str, rest: str) -> TierSpec:
    url = urlsplit("//" + rest.removeprefix("//"))
    master = _host_port(url)
    if master is None:
        raise ConfigError("mooncake tier spec needs the master's host:port, e.g. mooncake://127.0.0.1:50051; "
                          f"got {spec!r}")
    options = {k: v[-1] for k, v in parse_qs(url.query).items()}
    unknown = set(options) - set(MOONCAKE_OPTIONS)
    if unknown:
        raise ConfigError(f"unknown mooncake tier option(s) {', '.join(sorted(unknown))} in {spec!r}: "
                        f"use {', '.join(MOONCAKE_OPTIONS)}")
    for option in ("segment", "buffer"):
        parse_bytes(options.get(option, "0"))
    return TierSpec("mooncake", spec, None, url=master, options=options)


def _redis(spec: str, rest: str) -> TierSpec:
    url = urlsplit(spec)
    if url.scheme == "unix":
        if not url.path:
            raise ConfigError(f"redis unix tier spec needs a socket path: unix:///path/redis.sock, got {spec!r}")
    elif not rest.startswith("//") or not url.hostname or _host_port(url, default_port=6379) is None:
        raise ConfigError(f"redis tier spec needs a host: redis://HOST:PORT/DB, got {spec!r}")
    elif url.path.strip("/") and not url.path.strip("/").isdigit():
        raise ConfigError(f"redis tier spec: the database must be a number (redis://HOST:PORT/0), got {spec!r}")
    return TierSpec("redis", spec, None, url=spec)


def _host_port(url, default_port: int | None = None) -> str | None:
    """`host:port` of a split URL, or None when the host is missing or the port is not a number."""
    try:
        port = url.port or default_port
    except ValueError:
        return None
    return f"{url.hostname}:{port}" if url.hostname and port else None


def _positive_size(spec: str, size: str) -> int:
    num_bytes = parse_bytes(size)
    if num_bytes <= 0:
        raise ConfigError(f"tier spec {spec!r}: the size must be positive")
    return num_bytes


_PARSERS = {"dram": _dram, "ssd": _disk, "shm": _disk, "mooncake": _mooncake,
            **{scheme: _redis for scheme in _REDIS_SCHEMES}}


def parse_specs(specs: str | list[str | TierSpec] | tuple[str | TierSpec, ...]) -> list[TierSpec]:
    """A list of specs (one string is one spec), parsed."""
    if isinstance(specs, str):
        specs = [specs]
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"tiers must be a list of tier specs ({USAGE}), got {specs!r}")
    return [TierSpec.parse(spec) for spec in specs]
