"""`kvtier serve` configuration: one dataclass, from flags or one TOML/YAML file (flags win)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from kvtier.errors import UserError
from kvtier.units import parse_bytes


def default_tiers() -> list[str]:
    from kvtier.models import cache_dir

    return ["dram:1GiB", f"ssd:{cache_dir() / 'serve-ssd'}:4GiB"]


@dataclass(slots=True)
class ServeConfig:
    model: str = "smollm2"
    served_model_name: str | list[str] | None = None  # one name or several aliases
    host: str = "127.0.0.1"
    port: int = 8000
    device_kv_budget: str = "512MiB"
    block_tokens: int = 256
    tiers: list[str] = field(default_factory=default_tiers)  # top first; [] = device prefix cache only
    codec: str = "raw"                   # blocks written to the tiers
    kv_codec: str = "raw"                # the format resident on the device: raw, fp8, int8, int4, int2
    tier_writes: str = "full"            # blocks go to the tiers when full ("full") or when evicted ("evict")
    max_num_seqs: int = 32
    max_prefill_tokens: int = 512
    prefix_caching: bool = True
    max_model_tokens: int | None = None
    record_trace: str | None = None      # append finished requests to this JSONL (Mooncake trace format)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise UserError(f"port must be 1-65535, got {self.port}")
        for name in ("block_tokens", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise UserError(f"{name} must be positive, got {getattr(self, name)}")
        from kvtier.engine.arena import ARENA_CODECS

        if self.tier_writes not in ("full", "evict"):
            raise UserError(f"tier_writes must be 'full' or 'evict', got {self.tier_writes!r}")
        if self.kv_codec not in ARENA_CODECS:
            raise UserError(f"kv_codec must be one of {', '.join(ARENA_CODECS)}, got {self.kv_codec!r}")
        parse_bytes(self.device_kv_budget)
        if self.served_model_name is not None and not self.model_names("x"):
            raise UserError("served_model_name must name at least one model")

    def model_names(self, default: str) -> list[str]:
        """The names a request's `model` may be (the first is the one reports use)."""
        if self.served_model_name is None:
            return [default]
        names = [self.served_model_name] if isinstance(self.served_model_name, str) else self.served_model_name
        return [name for name in names if name]

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides) -> "ServeConfig":
        """File values, then the overrides that are not None."""
        values = _read(Path(path)) if path else {}
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UserError(f"unknown serve setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**values)


def _read(path: Path) -> dict:
    if not path.is_file():
        raise UserError(f"config file {path} not found")
    text = path.read_text()
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text) or {}
        else:
            data = tomllib.loads(text)
    except Exception as exc:  # noqa: BLE001 — any parse error is the user's to fix
        raise UserError(f"cannot parse {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a table of settings")
    return {k.replace("-", "_"): v for k, v in data.items()}
