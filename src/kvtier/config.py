"""One place for configuration: the engine's settings (`EngineConfig`), and how a dataclass's fields
become user settings — keys of a TOML/YAML file and options of a command — each with one name, type,
default and help: its field's metadata (`setting(...)`). Values are checked once, in `__post_init__`.

Light on purpose (no torch): `kvtier serve --help` derives its options from these fields.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any, Callable, Literal, get_args

from kvtier.blocks import DEFAULT_BLOCK_TOKENS
from kvtier.errors import ConfigError
# the offload settings' types live in kvtier.offload.config; imported here for EngineConfig (and its importers)
from kvtier.offload.config import (DEFAULT_OFFLOAD_PAGE_TOKENS, DEFAULT_RECENT_BLOCKS,  # noqa: F401
                                   DEFAULT_SINK_BLOCKS, PAGE_SUMMARY_VECTORS, OffloadConfig, OffloadKind,
                                   OffloadMode, parse_offload, sparse_page_tokens)
from kvtier.units import SizeError, parse_bytes

_MiB = 1 << 20
KVFormat = Literal["raw", "fp8", "int8", "int4", "int2"]  # the device arena's formats
ARENA_CODECS: tuple[str, ...] = get_args(KVFormat)
TierWrites = Literal["full", "evict"]       # blocks go to the tiers when computed, or when the device evicts them


def setting(default: Any = MISSING, *, help: str, factory: Callable[[], Any] | None = None, name: str | None = None,
            flag: str | None = None, parse: Callable[[Any], Any] | None = None, shown: str | None = None) -> Any:
    """A dataclass field that is also a user setting: `name` in files (default: the field's name),
    `--flag` on the command line (default: the name, dashed); `parse` turns what the user wrote into
    the field's value (`parse_bytes`); `shown` is the default as help prints it."""
    metadata = {"help": help, "name": name, "flag": flag, "parse": parse, "shown": shown}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True, slots=True)
class Setting:
    """One user setting: where it lands (`path` of field names), its type, default and help."""

    name: str
    path: tuple[str, ...]
    type: Any
    default: Any                       # MISSING when a factory makes it
    factory: Callable[[], Any] | None  # called only when needed (the serve default reads the cache dir)
    help: str
    flag: str
    parse: Callable[[Any], Any] | None
    shown: str | None

    def convert(self, value: Any) -> Any:
        """What a user wrote (a file, a flag) -> the field's value; a wrong type is a one-line error."""
        if self.parse is not None:
            try:
                return self.parse(value)
            except SizeError as exc:
                raise ConfigError(f"{self.name}: {exc}") from None
        if not _matches(self.type, value):
            raise ConfigError(f"{self.name} must be {_type_name(self.type)}, got {value!r}")
        return value

    def default_value(self) -> Any:
        return self.factory() if self.factory is not None else self.default

    def default_text(self) -> str | None:
        if self.shown is not None:
            return self.shown
        default = self.default_value()
        if default is None or default == []:
            return None
        if self.parse is parse_bytes:
            return _exact_bytes(default)
        return str(default).lower() if isinstance(default, bool) else str(default)

    def parameter(self, *, layered: bool) -> inspect.Parameter:
        """A typer option. `layered`: the option defaults to None (a file or the dataclass fills it in)
        and help names the default; otherwise it defaults to the field's default."""
        import typer

        cli_type = _cli_type(self)
        default = None if layered else self.default_value()
        help_text = self.help
        if layered and self.default_text() is not None:
            help_text += f" (default: {self.default_text()})"
        flags = [f"--{self.flag}/--no-{self.flag}"] if cli_type is bool else [f"--{self.flag}"]
        option = typer.Option(default, *flags, help=help_text, show_default=not layered)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=cli_type)


def settings_of(cls: type) -> list[Setting]:
    """The user settings of a config dataclass, nested config dataclasses flattened in (their fields'
    names are the settings' names: `kvtier serve --block-tokens` sets `ServeConfig.engine.block_tokens`)."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in fields(cls):
        if is_dataclass(hints[f.name]):
            found += [_nested(s, f.name) for s in settings_of(hints[f.name])]
        elif "help" in f.metadata:
            factory = None if f.default_factory is MISSING else f.default_factory
            name = f.metadata["name"] or f.name
            found.append(Setting(name, (f.name,), hints[f.name], f.default, factory, f.metadata["help"],
                                 f.metadata["flag"] or name.replace("_", "-"), f.metadata["parse"], f.metadata["shown"]))
    return found


def from_settings(cls: type, values: dict[str, Any], *, what: str) -> Any:
    """`cls` built from user settings by name (a file's keys, flags); unknown names are refused."""
    known = {s.name: s for s in settings_of(cls)}
    values = {k.replace("-", "_"): v for k, v in values.items()}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown {what} setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    tree: dict[str, Any] = {}
    for name, value in values.items():
        *parents, leaf = known[name].path
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = known[name].convert(value)
    return _build(cls, tree)


def command_settings(*settings: Setting, layered: bool) -> Callable[[Callable], Callable]:
    """A decorator giving a typer command one option per setting; the command function receives them
    as `settings` (a dict by setting name; with `layered`, None for each one not given)."""

    def wrap(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "settings"]
        params = own + [s.parameter(layered=layered) for s in settings]

        def command(**kwargs):
            chosen = {s.name: kwargs.pop(s.name) for s in settings}
            if layered:  # an option typer fills with an empty list was not given
                chosen = {k: None if v in ([], ()) else v for k, v in chosen.items()}
            return fn(**kwargs, settings=chosen)

        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        command.__name__, command.__doc__ = fn.__name__, fn.__doc__
        return command

    return wrap


def pick(settings: list[Setting], *names: str) -> list[Setting]:
    by_name = {s.name: s for s in settings}
    return [by_name[name] for name in names]


@dataclass(slots=True)
class EngineConfig:
    """The serving engine's settings (`LLMEngine`); `kvtier serve` takes each as a flag or a file key."""

    device_kv_budget_bytes: int = setting(512 * _MiB, name="device_kv_budget", parse=parse_bytes,
                                          help="device KV arena size, e.g. 512MiB")
    block_tokens: int = setting(DEFAULT_BLOCK_TOKENS, help="tokens per KV block")
    max_num_seqs: int = setting(32, help="running sequences at most")
    max_prefill_tokens: int = setting(512, help="prompt tokens computed per step, all sequences together "
                                                "(chunked prefill)")
    prefix_caching: bool = setting(True, help="reuse cached prefixes (device and tiers)")
    codec: str = setting("raw", help="codec of blocks written to the tiers: raw, fp8, int8, int4, int2, "
                                     "optionally +zstd")
    tier_writes: TierWrites = setting("full", help="full (each block as soon as it is computed) or evict "
                                                   "(when the device evicts it)")
    kv_codec: KVFormat = setting("raw", help="KV format resident on the device: raw, fp8, int8 (per token), "
                                             "int4, int2 (KIVI; the open block stays exact)")
    max_model_tokens: int | None = setting(None, help="context limit", shown="the model's")
    synchronous_transfers: bool = False  # tier I/O at submission on the step thread (tests, debugging)
    # contexts larger than the device (kvtier/offload/): a request longer than the device holds keeps
    # `offload_sink_blocks` + `offload_recent_blocks` blocks on the device, the rest pinned in the DRAM tier
    kv_offload: str = setting("off", help="requests longer than the device budget: off (refused), exact (every "
                                          "host block attended), sparse:1/8 or sparse:N (Quest-picked pages); "
                                          "their middle blocks live in the DRAM tier")
    offload_sink_blocks: int = setting(DEFAULT_SINK_BLOCKS,
                                       help="blocks an offloaded request keeps at its start (attention sinks)")
    offload_recent_blocks: int = setting(DEFAULT_RECENT_BLOCKS,
                                         help="most recent blocks an offloaded request keeps on the device")
    offload_fetch_blocks: int = setting(0, help="layer-blocks per half of the offload fetch area (taken from the "
                                                "budget)", shown="0: 1/8 of the budget")
    offload_page_tokens: int = setting(DEFAULT_OFFLOAD_PAGE_TOKENS, help="tokens per page sparse:BUDGET scores and "
                                       "fetches (Quest's unit; divides block_tokens; more: the block)")

    def offload_mode(self) -> OffloadMode | None:
        """The default `OffloadMode` (None: off)."""
        return parse_offload(self.kv_offload)

    def offload_config(self) -> OffloadConfig:
        """The offload settings, parsed: the default mode and the window's layout (the engine builds it once)."""
        return OffloadConfig(self.offload_mode(), self.block_tokens, self.offload_sink_blocks,
                             self.offload_recent_blocks, self.offload_page_tokens, self.offload_fetch_blocks)

    @property
    def page_tokens(self) -> int:
        """Tokens per page sparse offload selects (`offload_page_tokens`, at most a block)."""
        return sparse_page_tokens(self.offload_page_tokens, self.block_tokens)

    def __post_init__(self) -> None:
        if self.tier_writes not in get_args(TierWrites):
            raise ConfigError(f"tier_writes must be 'full' or 'evict', got {self.tier_writes!r}")
        if self.kv_codec not in ARENA_CODECS:
            raise ConfigError(f"kv_codec must be one of {', '.join(ARENA_CODECS)}, got {self.kv_codec!r}")
        for name in ("device_kv_budget_bytes", "block_tokens", "max_num_seqs", "max_prefill_tokens",
                     "offload_recent_blocks", "offload_page_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_setting_name(name)} must be positive (>= 1), got {getattr(self, name)}")
        for name in ("offload_sink_blocks", "offload_fetch_blocks"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        try:
            offload = self.offload_mode()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if offload is not None:
            try:
                self.page_tokens
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if offload is not None and (self.kv_codec != "raw" or self.codec != "raw"):
            raise ConfigError(f"kv_offload needs the raw device and tier formats (kv_codec {self.kv_codec!r}, "
                              f"codec {self.codec!r}): offloaded blocks are attended to as they are; kv_codec raw "
                              f"and codec raw work")
        if self.max_model_tokens is not None and self.max_model_tokens <= 0:
            raise ConfigError(f"max_model_tokens must be positive (>= 1), got {self.max_model_tokens}")
        from kvtier.codecs import get_codec

        get_codec(self.codec)  # an unknown codec: a UserError naming it


def _setting_name(field_name: str) -> str:
    """The name a user sets a field by (`device_kv_budget` for `device_kv_budget_bytes`)."""
    return "device_kv_budget" if field_name == "device_kv_budget_bytes" else field_name


def _nested(s: Setting, parent: str) -> Setting:
    return Setting(s.name, (parent, *s.path), s.type, s.default, s.factory, s.help, s.flag, s.parse, s.shown)


def _build(cls: type, tree: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    kwargs = {k: _build(hints[k], v) if is_dataclass(hints[k]) else v for k, v in tree.items()}
    return cls(**kwargs)


def _strip_none(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


def _cli_type(s: Setting) -> Any:
    tp = _strip_none(s.type)
    if typing.get_origin(tp) in (list, tuple):
        return list[str]
    if s.parse is not None or typing.get_origin(tp) is Literal:
        return str
    return tp


def _matches(tp: Any, value: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(arg, value) for arg in get_args(tp))
    if origin is Literal:
        return isinstance(value, str)  # which values: __post_init__ says
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_matches(get_args(tp)[0], v) for v in value)
    if tp is type(None):
        return value is None
    if tp in (int, float):
        return isinstance(value, (int, float) if tp is float else int) and not isinstance(value, bool)
    return not isinstance(tp, type) or isinstance(value, tp)


def _type_name(tp: Any) -> str:
    tp = _strip_none(tp)
    if typing.get_origin(tp) is Literal:
        return "a string"
    return {int: "an integer", bool: "true or false", str: "a string", float: "a number"}.get(tp, str(tp))


def _exact_bytes(num_bytes: int) -> str:
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if num_bytes % unit == 0:
            return f"{num_bytes // unit}{name}"
    return str(num_bytes)
