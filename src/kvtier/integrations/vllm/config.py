"""The connector's settings (`kv_connector_extra_config`) and the block layout and key space vLLM implies.

One kvtier block is one vLLM block (`--block-size` tokens), all layers: `[L, 2, H_kv, block_size, D]` (MLA:
`[L, 1, 1, block_size, latent]`), in the KV cache's dtype (fp8 KV: its fp8 format, stored as vLLM's bytes).
Keys chain over token ids from a root naming the weights, the layout, the codec and the request's
`cache_salt` (vLLM's own block hashes name none of the model), so two models or two tenants never
meet in one pool.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from kvtier import models
from kvtier.blocks import KeySpace, KVLayout
from kvtier.integrations.vllm.layouts import kv_dtype
from kvtier.tiers.spec import TierSpec, parse_specs

_KNOWN_KEYS = {"tiers", "codec", "fingerprint", "max_pending_saves", "load"}
LOAD_MODES = ("layerwise", "async")


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """`{"tiers": ["dram:4GiB", "ssd:/path:100GiB", "mooncake://HOST:PORT"], "codec": "raw"}`."""

    tiers: tuple[TierSpec, ...]     # strings are parsed (`TierSpec.parse`)
    codec: str = "raw"
    fingerprint: str | None = None  # names the weights; default: derived from the model (directory)
    max_pending_saves: int = 256    # jobs queued on the worker's one writer (saves, write-through); past it a save is dropped
    # "layerwise": the load runs with the request's first forward, each layer waited for just before use;
    # "async": a request waits (WAITING_FOR_REMOTE_KVS) until its whole load landed, the engine steps on.
    # Layerwise is the default: it measured the better TTFT in `kvtier bench vllm` (docs/benchmarks/vllm.md).
    load: str = "layerwise"

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError('kv_connector_extra_config needs "tiers": a non-empty list of tier specs '
                             '(as `kvtier serve --tier`: "dram:4GiB", "ssd:/path:100GiB", "mooncake://HOST:PORT")')
        object.__setattr__(self, "tiers", tuple(parse_specs(self.tiers)))
        if not self.shared_tiers:
            raise ValueError("KvtierConnector needs an shm, SSD or pool tier (a DRAM tier alone is not enough): vLLM's "
                             "scheduler runs in another process than its worker and looks blocks up there; for DRAM "
                             'every process sees, use "shm:/dev/shm/DIR:SIZE"')
        if self.load not in LOAD_MODES:
            raise ValueError(f'"load" must be one of {LOAD_MODES}, got {self.load!r}')
        if self.max_pending_saves <= 0:
            raise ValueError(f"max_pending_saves must be positive, got {self.max_pending_saves}")

    @property
    def shared_tiers(self) -> tuple[TierSpec, ...]:
        """The tiers every process sees (not the worker's own DRAM)."""
        return tuple(spec for spec in self.tiers if spec.shared)

    @classmethod
    def from_extra_config(cls, extra: dict) -> ConnectorConfig:
        unknown = sorted(set(extra) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}: use {sorted(_KNOWN_KEYS)}")
        tiers = extra.get("tiers") or ()
        if isinstance(tiers, str):
            tiers = [tiers]
        return cls(tiers=tuple(tiers), codec=str(extra.get("codec", "raw")), fingerprint=extra.get("fingerprint"),
                   max_pending_saves=int(extra.get("max_pending_saves", 256)), load=str(extra.get("load", "layerwise")))


def check_supported(vllm_config) -> None:
    """What this connector does not (yet) handle, refused at start rather than served wrong."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError("KvtierConnector supports tensor parallelism, not pipeline parallelism "
                         "(--pipeline-parallel-size 1)")
    context = (getattr(parallel, "decode_context_parallel_size", 1), getattr(parallel, "prefill_context_parallel_size", 1))
    if context != (1, 1):
        raise ValueError("KvtierConnector keeps every token of a block on each rank: decode/prefill context "
                         f"parallel sizes must be 1, got {context}")
    kv_dtype(vllm_config.cache_config.cache_dtype, "auto")  # raises for a KV format it does not know
    if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute":
        raise ValueError('KvtierConnector needs "kv_load_failure_policy": "recompute" in --kv-transfer-config: '
                         "a block that turns out corrupt or missing is then recomputed instead of failing the request")


def layout_for(vllm_config, page: str = "") -> KVLayout:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = kv_dtype(vllm_config.cache_config.cache_dtype, str(model.dtype).removeprefix("torch."))
    latent = bool(model.use_mla)  # MLA: one latent of `get_head_size()` (kv_lora_rank + rope dim) per token
    return KVLayout(num_layers=model.get_num_layers(parallel), num_kv_heads=model.get_num_kv_heads(parallel),
                    head_dim=model.get_head_size(), dtype=dtype, block_tokens=vllm_config.cache_config.block_size,
                    latent=latent, page=page)


def fingerprint_for(vllm_config) -> str:
    model = vllm_config.model_config
    return model_fingerprint(model.model, model.revision, model.quantization)


def model_fingerprint(model: str, revision: str | None = None, quantization: str | None = None) -> str:
    """A local model directory is named by its files (as `kvtier serve` names it); a hub name by name and revision."""
    base = models.fingerprint_dir(Path(model)) if Path(model).is_dir() else f"{model}@{revision or 'main'}"
    return hashlib.sha256(f"{base}/{quantization or 'none'}".encode()).hexdigest()[:16]


def key_space(vllm_config, config: ConnectorConfig, page: str = "") -> KeySpace:
    """`page`: `layouts.engine_page(vllm_config)` (imports vLLM)."""
    layout = layout_for(vllm_config, page)
    if (layout.latent or layout.dtype.startswith("float8")) and config.codec.removesuffix("+zstd") != "raw":
        raise ValueError(f'KvtierConnector stores {"an MLA latent" if layout.latent else "fp8 KV"} as vLLM\'s bytes: '
                         f'"codec" must be "raw" or "raw+zstd", got {config.codec!r}')
    return KeySpace(config.fingerprint or fingerprint_for(vllm_config), layout, config.codec)
