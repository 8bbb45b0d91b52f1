"""What the engine refuses to be built with, checked before anything is built.

`check_engine` is the first thing `LLMEngine.__init__` does (`kvtier serve` also calls it, with `check_tiers`,
before its tiers are built). Each refusal is one `ConfigError` line naming the setting and the smallest value that
works (or, for a count the engine needs fewer of, the largest). The arithmetic is the engine's own — the arena's
block slots (`arena.arena_block_bytes`), the offload fetch area (`fetch_area_bytes`, which `LLMEngine` sizes its
`FetchArea` by) — so a value named here does build an engine.
"""

from __future__ import annotations

from dataclasses import replace

from kvtier.blocks import KVLayout
from kvtier.config import EngineConfig
from kvtier.errors import ConfigError
from kvtier.offload.config import OffloadConfig
from kvtier.units import fmt_bytes

_KIVI = ("int4", "int2")
_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))


def fetch_half_blocks(layout: KVLayout, offload: OffloadConfig, budget_bytes: int) -> int:
    """Layer-blocks per half of the offload fetch area: `offload.fetch_blocks`, or 1/8 of the budget."""
    layer_block_bytes = layout.block_bytes // layout.num_layers
    return offload.fetch_blocks or max(1, budget_bytes // 8 // (2 * layer_block_bytes))


def fetch_area_bytes(layout: KVLayout, offload: OffloadConfig, budget_bytes: int) -> int:
    """`FetchArea`'s buffer: two halves of [2 (K, V), H, half blocks + the device window, D]."""
    tokens = (fetch_half_blocks(layout, offload, budget_bytes) + offload.window_blocks) * layout.block_tokens
    return 2 * 2 * layout.num_kv_heads * tokens * layout.head_dim * _element_bytes(layout)


def device_blocks(layout: KVLayout, config: EngineConfig, budget_bytes: int | None = None) -> int:
    """Block slots the arena gets: the budget less the offload fetch area and KIVI's open blocks."""
    from kvtier.engine.arena import arena_block_bytes

    budget = config.device_kv_budget_bytes if budget_bytes is None else budget_bytes
    offload = config.offload_config()
    if offload.mode is not None:
        budget -= fetch_area_bytes(layout, offload, budget)
    budget -= _open_blocks_bytes(layout, config, config.max_num_seqs)
    return max(0, budget // arena_block_bytes(layout, config.kv_codec)) if budget > 0 else 0


def blocks_needed(offload: OffloadConfig) -> int:
    """One block; with offload, an offloaded request's device window (sink + recent blocks) and one more."""
    return 1 if offload.mode is None else offload.window_blocks + 1


def check_engine(layout: KVLayout, config: EngineConfig, model_config=None, *, has_host_tier: bool) -> None:
    """Every refusal of engine construction, as a one-line ConfigError. `layout` is the model's at
    `config.block_tokens`; `has_host_tier`: the tier stack starts with a DRAM tier (offload's host memory)."""
    if model_config is not None:
        _check_full_attention(model_config)
    _check_kivi_head_dim(layout, config)
    offload = config.offload_config()  # the offload settings, parsed once
    if offload.mode is not None and not has_host_tier:
        raise ConfigError(f"kv_offload {offload.mode} needs a DRAM tier first in tiers (offloaded blocks live in its "
                          f"memory): start the tiers with dram:SIZE, e.g. --tier dram:4GiB")
    _check_budget(layout, config, offload)


def check_tiers(tiers, slot_bytes: int) -> None:
    """A DRAM tier holds at least one block slot (`slot_bytes`: a block encoded by the tier codec)."""
    for spec in tiers:
        if spec.kind == "dram" and spec.capacity_bytes < slot_bytes:
            raise ConfigError(f"tier {spec} holds no block (a slot is {slot_bytes:,} B): "
                              f"dram:{_size(_round_up(slot_bytes))} works")


def _check_full_attention(model_config) -> None:
    # paged attention attends to every cached token: a sliding-window layer would see too much
    layer_types = getattr(model_config, "layer_types", None) or []
    sliding = getattr(model_config, "sliding_window", None) and getattr(model_config, "use_sliding_window", True)
    if any(kind != "full_attention" for kind in layer_types) or sliding:
        raise ConfigError("model: the engine serves full-attention models only, and this one has sliding-window "
                          "layers (smollm2, or a Llama / Qwen2 / Qwen3 / Mistral directory without one, works)")


def _check_kivi_head_dim(layout: KVLayout, config: EngineConfig) -> None:
    """KIVI packs head_dim (and a value group: at most 64 channels) of b-bit codes into whole bytes."""
    def packs(codec: str) -> bool:
        bits = int(codec[3:])
        return layout.head_dim * bits % 8 == 0 and min(64, layout.head_dim) * bits % 8 == 0

    if config.kv_codec in _KIVI and not packs(config.kv_codec):
        works = next(codec for codec in ("int2", "int4", "int8") if codec == "int8" or packs(codec))
        raise ConfigError(f"kv_codec {config.kv_codec} cannot pack this model's head_dim ({layout.head_dim}) of "
                          f"{config.kv_codec[3:]}-bit codes into whole bytes: kv_codec {works} works")


def _check_budget(layout: KVLayout, config: EngineConfig, offload: OffloadConfig) -> None:
    need, have = blocks_needed(offload), device_blocks(layout, config)
    if have >= need:
        return
    beside = []
    if offload.mode is not None:
        area = fetch_area_bytes(layout, offload, config.device_kv_budget_bytes)
        beside.append(f"the offload fetch area ({fmt_bytes(area)})")
    if config.kv_codec in _KIVI:
        beside.append(f"the {config.max_num_seqs} open blocks {config.kv_codec} keeps at full precision "
                      f"({fmt_bytes(_open_blocks_bytes(layout, config, config.max_num_seqs))})")
    wanted = (f"{need} (an offloaded request's window: {offload.sink_blocks} sink + "
              f"{offload.recent_blocks} recent blocks, and one more)" if offload.mode is not None else "1")
    others = [alt for alt in (_block_tokens_that_works(layout, config, offload, need),
                              _fetch_blocks_that_works(layout, config, offload, need),
                              _num_seqs_that_works(layout, config, need)) if alt]
    blocks = f"{have} block{'s' * (have != 1)} of {layout.block_tokens} tokens"
    beside_text = f" beside {' and '.join(beside)}" if beside else ""
    raise ConfigError(f"device_kv_budget {_size(config.device_kv_budget_bytes)} holds {blocks}{beside_text}; "
                      f"the engine needs {wanted}: device_kv_budget {_smallest_budget(layout, config, offload, need)} "
                      f"works{' (or ' + ', or '.join(others) + ')' if others else ''}")


def _smallest_budget(layout: KVLayout, config: EngineConfig, offload: OffloadConfig, need: int) -> str:
    """The smallest budget in whole units of its size (MiB for a budget of MiBs) whose arena holds `need` blocks.
    Walked up, not solved: the fetch area grows with the budget (1/8 of it), so blocks do not grow steadily."""
    from kvtier.engine.arena import arena_block_bytes

    least = _open_blocks_bytes(layout, config, config.max_num_seqs) + need * arena_block_bytes(layout, config.kv_codec)
    if offload.mode is not None:
        least += fetch_area_bytes(layout, offload, 0)
    unit = next(size for size, _ in _UNITS if least >= size)
    count = -(-least // unit)
    while device_blocks(layout, config, count * unit) < need:
        count += 1
    return _size(count * unit)


def _block_tokens_that_works(layout: KVLayout, config: EngineConfig, offload: OffloadConfig,
                             need: int) -> str | None:
    """The largest smaller block that fits the budget (a whole number of sparse pages, when offloading)."""
    for tokens in range(layout.block_tokens - 1, 0, -1):
        if offload.mode is not None and tokens % min(offload.page_tokens, tokens):
            continue
        if device_blocks(replace(layout, block_tokens=tokens), config) >= need:
            return f"block_tokens {tokens}"
    return None


def _fetch_blocks_that_works(layout: KVLayout, config: EngineConfig, offload: OffloadConfig,
                             need: int) -> str | None:
    """With offload_fetch_blocks set: the largest that leaves room for the window."""
    if offload.mode is None or not offload.fetch_blocks:
        return None
    for blocks in range(offload.fetch_blocks - 1, 0, -1):
        if device_blocks(layout, replace(config, offload_fetch_blocks=blocks)) >= need:
            return f"offload_fetch_blocks {blocks}"
    return None


def _num_seqs_that_works(layout: KVLayout, config: EngineConfig, need: int) -> str | None:
    """KIVI: the most sequences whose open blocks leave room for `need` blocks."""
    if config.kv_codec not in _KIVI:
        return None
    from kvtier.engine.arena import arena_block_bytes

    most = (config.device_kv_budget_bytes - need * arena_block_bytes(layout, config.kv_codec)) // layout.block_bytes
    return f"max_num_seqs {most}" if most >= 1 else None


def _open_blocks_bytes(layout: KVLayout, config: EngineConfig, num_seqs: int) -> int:
    """KIVI's open blocks, one per running sequence at full precision (make_arena's reserve)."""
    return num_seqs * layout.block_bytes if config.kv_codec in _KIVI else 0


def _element_bytes(layout: KVLayout) -> int:
    return layout.bytes_per_token // (layout.num_parts * layout.num_layers * layout.num_kv_heads * layout.head_dim)


def _round_up(num_bytes: int) -> int:
    unit = next(size for size, _ in _UNITS if num_bytes >= size)
    return -(-num_bytes // unit) * unit


def _size(num_bytes: int) -> str:
    """A byte size as a setting takes it: `45MiB`, `1536KiB`, `1000B` (the largest unit that divides it)."""
    size, name = next((size, name) for size, name in _UNITS if num_bytes % size == 0)
    return f"{num_bytes // size}{name}"
