"""`kvtier serve` configuration: one dataclass holding the engine's, from flags or one TOML/YAML file.

Precedence: flags > file > defaults. A file's keys and the flags are the same settings (`setting(...)`
fields, the engine's flattened in: `device_kv_budget`, `block_tokens`, ...), dashes or underscores.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.config import EngineConfig, Setting, from_settings, setting, settings_of
from kvtier.errors import ConfigError, UserError
from kvtier.events.publisher import KvEventsConfig
from kvtier.tiers.spec import TierSpec, parse_specs


GENERATION_CONFIG_MODES = ("auto", "vllm")  # vLLM's --generation-config values: the model's, or its own (OpenAI's)


def default_tiers() -> list[TierSpec]:
    from kvtier.models import cache_dir

    return parse_specs(["dram:1GiB", f"ssd:{cache_dir() / 'serve-ssd'}:4GiB"])


def _names(value: str | list[str] | None) -> list[str] | None:
    """One served model name or several aliases (a file may give either), empty names dropped."""
    if value is None:
        return None
    names = [value] if isinstance(value, str) else list(value)
    if not all(isinstance(name, str) for name in names):
        raise ConfigError(f"served_model_name must be a name or a list of names, got {value!r}")
    return [name for name in names if name]


@dataclass(slots=True)
class ServeConfig:
    model: str = setting("smollm2", help="smollm2 (default, embedded), tiny, or a local HF model directory")
    served_model_name: list[str] | None = setting(None, parse=_names, help="the model id clients send and "
                                                  "/v1/models lists; repeat for aliases", shown="the model's name")
    host: str = setting("127.0.0.1", help="bind address")
    port: int = setting(8000, help="port")
    # top first; [] = the device prefix cache only
    tiers: list[TierSpec] = setting(factory=default_tiers, flag="tier", parse=parse_specs,
                                    shown="dram:1GiB + ssd under the kvtier cache dir",
                                    help="a tier below the device, top first; repeat: --tier dram:1GiB "
                                         "--tier ssd:/path:4GiB (shm:, mooncake://, redis:// too)")
    record_trace: str | None = setting(None, help="append each finished request to this JSONL in the Mooncake "
                                                  "trace format, for `kvtier simulate`")
    generation_config: str = setting("auto", help="what a request's omitted sampling fields default to: auto (the "
                                                  "model's generation_config, as transformers' generate() reads it: "
                                                  "greedy unless it sets do_sample) or vllm (OpenAI's: temperature 1, "
                                                  "top_p 1)")
    kv_events_config: KvEventsConfig | None = setting(
        None, parse=KvEventsConfig.parse, help="publish the device's and every tier's blocks as vLLM's KV cache events "
        "(vLLM's JSON: '{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": "
        "...}'; ZMQ PUB, msgpack KVEventBatch)")
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be 1-65535, got {self.port}")
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ConfigError(f"generation_config must be auto or vllm, got {self.generation_config!r}")
        self.tiers = parse_specs(self.tiers)
        if self.kv_events_config is not None:
            self.kv_events_config = KvEventsConfig.parse(self.kv_events_config)
        self.served_model_name = _names(self.served_model_name)
        if self.served_model_name is not None and not self.served_model_name:
            raise ConfigError("served_model_name must name at least one model")

    def model_names(self, default: str) -> list[str]:
        """The names a request's `model` may be (the first is the one reports use): the served names, or
        else the model as given (`smollm2`, a directory: vLLM serves `--model` as it is given) and its name."""
        return list(self.served_model_name) if self.served_model_name else list(dict.fromkeys([self.model, default]))

    @classmethod
    def settings(cls) -> list[Setting]:
        return settings_of(cls)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides) -> ServeConfig:
        """File values, then the overrides (flags) that are not None."""
        values = _read(Path(path)) if path else {}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return from_settings(cls, values, what="serve")


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
    return data
