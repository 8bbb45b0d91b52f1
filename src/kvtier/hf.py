"""The transformers integration: `TieredCache`, a `Cache` backed by kvtier's tier manager.

Targets the Cache API of transformers 5.20-5.23 (`Cache(layers=...)` of `CacheLayerMixin`s).

    cache = TieredCache.for_model(loaded, manager)
    num_cached = cache.load_prefix(input_ids)           # longest cached prefix from DRAM/pool/SSD
    out = model.generate(input_ids, past_key_values=cache, ...)   # computes only the rest
    cache.store(out[0])                                 # new full blocks go down to the tiers

Four things over `DynamicCache`:
- prefix reuse across requests and processes (blocks keyed by `kvtier.blocks`, bytes by `kvtier.codecs`);
- in-place growth with capacity doubling, so a decode step copies one token's KV, not the whole
  cache (`DynamicLayer` re-concatenates every layer on every step);
- contexts larger than the device (issue 18, `kv_offload`, the layers of `hf_offload`): each layer
  keeps `offload_sink_blocks` + `offload_recent_blocks` blocks on the device and its middle blocks in
  (pinned) host memory; `exact` attends to all of them (token-identical to `DynamicCache`), `sparse:BUDGET`
  at a decode step to the top pages (`offload_page_tokens`) of each KV head by their key summaries, picked by the
  engine's functions;
- optionally quantized resident KV (`resident_codec`: fp8, int8, KIVI int4/int2, the layers of
  `levers.quantized_cache` with their full-precision residual), whose blocks go to the tiers as
  attention sees them, in a key space of their own.

    cache = TieredCache.for_model(loaded, manager, kv_offload="sparse:1/8")   # or "exact"
    out = model.generate(input_ids, past_key_values=cache, ...)
    cache.offload_stats.fetched_bytes_per_token                             # host -> device per decode token

Why block windows, and no longer whole layers past a byte budget (`device_kv_budget_bytes`, until
issue 18): a layer kept whole grows with the context, so the resident KV had no bound but the
context's; a window's is fixed, (sink + recent) blocks per layer. `exact` over the same window is
the reference `sparse` is measured against (a budget covering every host block is `exact`, as in the
engine), and it stays token-identical to `DynamicCache` (it returns the same K/V values). What it
gives up: with a budget that held most layers whole, the old scheme moved only the other layers'
KV per step; `exact` moves every layer's middle blocks (on CUDA staged on a side stream during the
layer before, as the old scheme did — not yet run on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvtier.blocks import DEFAULT_BLOCK_TOKENS, KeyChain, KeySpace, KVLayout, key_codec
from kvtier.codecs import get_codec
from kvtier.codecs.codec import byte_array
from kvtier.offload.config import (DEFAULT_OFFLOAD_PAGE_TOKENS, DEFAULT_RECENT_BLOCKS, DEFAULT_SINK_BLOCKS,
                                   OffloadConfig, OffloadMode, parse_offload)
from kvtier.offload.stats import OffloadStats
from kvtier.hf_offload import OffloadLayer, QueryTap
from kvtier.transfer import BlockMover, KeptBlocks
from kvtier.transfer.copies import CopyGroup, copy_threads

_MIN_CAPACITY_TOKENS = 256


@dataclass(slots=True)
class PrefixStats:
    """What `load_prefix` / `store` did for one request."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    stored_blocks: int = 0


class _BlockCopier:
    """Writes decoded blocks [L, 2, H, T, D] at a token offset into the layers' joined K/V buffers
    [L, 2, 1, H, capacity, D] (`TieredCache._join_buffers`: every layer's buffers are views of one
    allocation), so a block is one strided copy over all its layers. On the CPU, numpy memcpys over a
    byte view made once, cut into one copy per thread of a `CopyGroup` (a restore before the forward runs
    alone: its copies use the cores torch may use; torch's own multi-threaded copy of many mid-sized
    slices collapses, 10-100x, when the cores are shared with other work); devices and dtype changes go
    through `copy_`."""

    def __init__(self, joined: torch.Tensor, group: CopyGroup | None = None) -> None:
        self.joined = joined
        self.group = group or CopyGroup(1)
        self.np_view = byte_array(joined) if joined.device.type == "cpu" else None

    def at(self, block_tokens: int) -> "_TokenOffsets":
        """The mover's sink: block i of the prefix goes to tokens [i * block_tokens, ...)."""
        return _TokenOffsets(self, block_tokens)

    def __call__(self, block: torch.Tensor, start: int) -> None:
        end = start + block.shape[3]
        if self.np_view is not None and block.device.type == "cpu" and block.dtype == self.joined.dtype \
                and block.is_contiguous():
            self.group.add_split(self.np_view[:, :, 0, :, start:end], byte_array(block))
            return
        self.joined[:, :, 0, :, start:end].copy_(block, non_blocking=True)


@dataclass(slots=True)
class _TokenOffsets:
    copy: _BlockCopier
    block_tokens: int

    def write(self, index: int, block: torch.Tensor) -> None:
        self.copy(block, index * self.block_tokens)


class TieredLayer(DynamicLayer):
    """A `DynamicLayer` over a preallocated buffer that grows by doubling.

    `keys`/`values` are views `[B, H, n, D]` of `_k_buf`/`_v_buf` `[B, H, capacity, D]`.
    """

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._k_buf: torch.Tensor | None = None
        self._v_buf: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = key_states[..., :0, :]
        self.values = value_states[..., :0, :]
        self.is_initialized = True

    def reserve(self, key_like: torch.Tensor, num_tokens: int) -> None:
        """Make room for `num_tokens` in total without reallocating later."""
        n = self.get_seq_length()
        if self._owns_views() and self._k_buf.shape[-2] >= num_tokens:
            return
        b, h, _, d = key_like.shape
        capacity = max(num_tokens, _MIN_CAPACITY_TOKENS)
        k_buf = torch.empty((b, h, capacity, d), dtype=key_like.dtype, device=self.device)
        v_buf = torch.empty_like(k_buf)
        if n:
            k_buf[..., :n, :].copy_(self.keys)
            v_buf[..., :n, :].copy_(self.values)
        self._k_buf, self._v_buf = k_buf, v_buf
        self.keys, self.values = k_buf[..., :n, :], v_buf[..., :n, :]

    def use_buffers(self, k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """Take `k_buf` / `v_buf` [B, H, capacity, D] as this empty layer's buffers (views of the cache's
        joined allocation: `TieredCache._join_buffers`)."""
        assert not self.get_seq_length(), "an empty layer takes new buffers"
        self._k_buf, self._v_buf = k_buf, v_buf
        self.keys, self.values = k_buf[..., :0, :], v_buf[..., :0, :]

    def reset(self) -> None:
        """Empty, keeping the buffers (already paged in: the next request's restore writes warm memory)."""
        if self._owns_views():
            self.set_length(0)
        else:
            super().reset()

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The preallocated K and V buffers [B, H, capacity, D] (after `reserve`)."""
        return self._k_buf, self._v_buf

    def set_length(self, num_tokens: int) -> None:
        """The first `num_tokens` of the buffers hold valid KV (written in place by the caller)."""
        self.keys, self.values = self._k_buf[..., :num_tokens, :], self._v_buf[..., :num_tokens, :]

    def _owns_views(self) -> bool:
        # `crop` keeps views of the buffer; `reorder_cache` & co. reassign new tensors (buffer stale).
        if self._k_buf is None:
            return False
        return self.keys.numel() == 0 or self.keys.data_ptr() == self._k_buf.data_ptr()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        if not self._owns_views() or self._k_buf.shape[-2] < n + t:
            capacity = 2 * (self._k_buf.shape[-2] if self._k_buf is not None else 0)
            self.reserve(key_states, max(n + t, capacity))
        # key_states: [B, H, t, D] on the compute device
        self._k_buf[..., n:n + t, :].copy_(key_states, non_blocking=True)
        self._v_buf[..., n:n + t, :].copy_(value_states, non_blocking=True)
        self.keys, self.values = self._k_buf[..., :n + t, :], self._v_buf[..., :n + t, :]
        return self.keys, self.values

    def nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        return self.keys.nbytes + self.values.nbytes


class TieredCache(Cache):
    """A transformers `Cache` whose full blocks are shared through kvtier's tiers.

    Lossless codecs give token-for-token the same greedy output as `DynamicCache`, with or without
    `kv_offload="exact"`. One sequence (batch size 1) per cache object when prefix reuse or sparse
    offload is used. `kv_offload`: None / "off", "exact", "sparse:1/8" (a fraction of the host pages)
    or "sparse:4" (pages per layer and KV head) — `kvtier.config.parse_offload`; a page is
    `offload_page_tokens` tokens of a block (the engine's default; the block when larger); a sparse cache
    needs the model whose queries pick the pages (`for_model` passes it).
    """

    def __init__(self, config, manager=None, *, model_fingerprint: str, codec: str = "raw",
                 namespace: str = "", block_tokens: int = DEFAULT_BLOCK_TOKENS, dtype: torch.dtype = torch.float32,
                 resident_codec: str = "raw", kv_offload: str | None = None,
                 offload_sink_blocks: int = DEFAULT_SINK_BLOCKS, offload_recent_blocks: int = DEFAULT_RECENT_BLOCKS,
                 offload_page_tokens: int = DEFAULT_OFFLOAD_PAGE_TOKENS, model: torch.nn.Module | None = None) -> None:
        text_config = config.get_text_config(decoder=True)
        layer_types = getattr(text_config, "layer_types", None) or []
        if any(kind != "full_attention" for kind in layer_types) or getattr(text_config, "sliding_window", None) \
                and getattr(text_config, "use_sliding_window", True):
            raise ValueError("TieredCache supports full-attention models only (sliding-window layers drop KV)")
        from kvtier.models import kv_layout

        self.layout: KVLayout = kv_layout(text_config, block_tokens, dtype)
        self.codec = get_codec(codec)
        self.resident_codec = resident_codec
        self.space = KeySpace(model_fingerprint, self.layout, key_codec(self.codec.name, resident_codec), namespace)
        self.manager = manager
        # restores and saves: the one block mover (saves on the caller's thread, as `store` returns)
        self.mover = BlockMover(manager, self.codec, layout=self.layout, synchronous=True) if manager else None
        self.chain = KeyChain(self.space)  # this sequence's keys, grown with its tokens, never rehashed
        self.prefix = PrefixStats()
        self._num_stored_blocks = 0
        self.offload: OffloadMode | None = parse_offload(kv_offload)  # ValueError for a bad string
        offload = None
        if self.offload is not None:  # the settings, parsed once (ValueError for a bad window or page)
            offload = OffloadConfig(self.offload, block_tokens, offload_sink_blocks, offload_recent_blocks,
                                    offload_page_tokens)
        exact = self.offload is not None and self.offload.kind == "exact"
        self._prefetch_stream = torch.cuda.Stream() if exact and torch.cuda.is_available() else None
        super().__init__(layers=_layers(self.layout, resident_codec, offload, model))

    @classmethod
    def for_model(cls, loaded, manager=None, **kwargs) -> "TieredCache":
        """Build from a `kvtier.models.LoadedModel` (its fingerprint and dtype)."""
        kwargs.setdefault("dtype", loaded.model.dtype)
        kwargs.setdefault("model", loaded.model)
        return cls(loaded.model.config, manager, model_fingerprint=loaded.fingerprint, **kwargs)

    def reset(self) -> None:
        """Ready for the next request, keeping every layer's buffers (transformers' `StaticCache.reset`
        idiom): a serving loop reuses one cache instead of paging in fresh memory per request."""
        super().reset()
        self.prefix = PrefixStats()
        self._num_stored_blocks = 0
        self.chain.reset()

    # -- the Cache hot path -------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._prefetch_stream is not None and key_states.device.type == "cuda":
            torch.cuda.current_stream(key_states.device).wait_stream(self._prefetch_stream)
            self._prefetch_next(layer_idx, key_states.device)
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    @property
    def quantized(self) -> bool:
        return self.resident_codec != "raw"

    def _prefetch_next(self, layer_idx: int, device: torch.device) -> None:
        next_idx = layer_idx + 1 if layer_idx + 1 < len(self.layers) else 0
        self._prefetch_stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._prefetch_stream):
            self.layers[next_idx].stage(device)

    # -- what the KV costs where (device, host, the host -> device link) ---------------------------
    @property
    def resident_bytes(self) -> int:
        """KV on the device: every token's, or with `kv_offload` the windows (allocated whole)."""
        return sum(layer.nbytes() for layer in self.layers)

    @property
    def offloaded_bytes(self) -> int:
        """KV in host memory: the middle blocks of every layer (0 without `kv_offload`)."""
        return sum(layer.host_bytes() for layer in self._offload_layers())

    @property
    def summary_bytes(self) -> int:
        """The per-page key min/max/mean on the device (sparse), apart from the KV."""
        return sum(layer.summary_bytes() for layer in self._offload_layers())

    @property
    def fetched_bytes(self) -> int:
        """Host -> device KV bytes since the cache was made (or reset)."""
        return sum(layer.fetched_bytes for layer in self._offload_layers())

    @property
    def fetched_bytes_per_token(self) -> float:
        """Host -> device KV bytes per decode step (one-token update), all layers."""
        return self.offload_stats.fetched_bytes_per_token

    @property
    def offload_stats(self) -> OffloadStats:
        """The engine's record of an offloaded request (`RequestOutput.offload`), for this sequence."""
        layers = self._offload_layers()
        if not layers:
            return OffloadStats()
        return OffloadStats(mode=str(self.offload), peak_device_kv_bytes=self.resident_bytes,
                            host_kv_bytes=self.offloaded_bytes, summary_bytes=self.summary_bytes,
                            fetched_bytes=self.fetched_bytes,
                            fetch_seconds=sum(layer.fetch_seconds for layer in layers),
                            num_decode_tokens=layers[0].num_decode_steps,
                            decode_fetched_bytes=sum(layer.decode_fetched_bytes for layer in layers))

    def _offload_layers(self) -> list[OffloadLayer]:
        return [layer for layer in self.layers if isinstance(layer, OffloadLayer)]

    # -- prefix reuse ---------------------------------------------------------------------------
    def load_prefix(self, input_ids: torch.Tensor, *, reserve_tokens: int = 0) -> int:
        """Fill the cache with the longest cached prefix of `input_ids` ([1, S] or [S]).

        At least the last prompt token is left to compute (the model needs its logits).
        Returns the number of cached tokens. `reserve_tokens` preallocates room for generation.
        """
        if self.get_seq_length():
            raise RuntimeError("load_prefix must be called on an empty cache")
        token_ids = input_ids.reshape(-1).tolist() if input_ids.dim() > 1 else input_ids.tolist()
        if input_ids.dim() > 1 and input_ids.shape[0] != 1:
            raise ValueError("prefix reuse works on one sequence per cache (batch size 1)")
        self.prefix = PrefixStats(prompt_tokens=len(token_ids))
        self.chain.reset()  # a new sequence
        block_tokens = self.layout.block_tokens
        usable_blocks = (len(token_ids) - 1) // block_tokens
        if self.manager is None or usable_blocks == 0:
            return 0
        keys = self.chain.extend(token_ids, usable_blocks)
        match = self.manager.match(keys, pin=True)  # kept from eviction until the restore has read them
        if not len(match):
            return 0
        capacity = len(token_ids) + reserve_tokens
        if self.quantized:
            tiers = self._fill_quantized(match)
        elif self.offload is not None:
            tiers = self._fill_window(match, capacity)
        else:
            tiers = self._fill(match, capacity)
        if not tiers:
            return 0
        num_cached = len(tiers) * block_tokens
        for tier in tiers:
            self.prefix.hit_tokens_by_tier[tier] = self.prefix.hit_tokens_by_tier.get(tier, 0) + block_tokens
        self.prefix.cached_tokens = num_cached
        self._num_stored_blocks = len(tiers)
        return num_cached

    def _fill(self, match, capacity_tokens: int) -> list[str]:
        """Stream the matched blocks ([L, 2, H, T, D] each) straight into the layers' buffers (views of
        one allocation, `_join_buffers`): each block is verified, then its copies (one per copy thread over
        all its layers, `CopyGroup.add_split`) go to the copy threads while the next block is read and
        verified; no concatenation. Returns the tier each restored block came
        from (fewer than matched: the prefix ended at a bad block, or the copies failed)."""
        h, d = self.layout.num_kv_heads, self.layout.head_dim
        like = torch.empty((1, h, len(match) * self.layout.block_tokens, d), dtype=self.layout_dtype, device="meta")
        self._initialize_layers()
        joined = self._join_buffers(like, capacity_tokens)
        threads = copy_threads() if self._compute_device().type == "cpu" else 1
        with CopyGroup(threads) as group:
            copy = _BlockCopier(joined, group)
            tiers = self.mover.restore(match, copy.at(self.layout.block_tokens), copies=group).tiers  # DRAM: its slots
        for layer in self.layers:
            layer.set_length(len(tiers) * self.layout.block_tokens)
        return tiers

    def _fill_window(self, match, capacity_tokens: int) -> list[str]:
        """Offloaded layers: the sink blocks into the device windows, the others into host memory;
        `OffloadLayer.restored` then moves the last ones into the recent window."""
        self._initialize_layers()
        for layer in self.layers:
            layer.reserve_host(-(-capacity_tokens // self.layout.block_tokens))
        tiers = self.mover.restore(match, _WindowSink(self.layers)).tiers
        for layer in self.layers:
            layer.restored(len(tiers))
        return tiers

    def _join_buffers(self, like: torch.Tensor, capacity_tokens: int) -> torch.Tensor:
        """Every layer's K and V buffers as views of one allocation [L, 2, 1, H, capacity, D] (the one the
        layers view already when it is large enough: `reset` keeps it paged in), so a restored block goes
        in with a few copies over all its layers, not one per layer and K/V. A layer that outgrows it later
        reallocates its own (`TieredLayer.update`), and the next restore joins them again."""
        layers = self.layers
        k0 = layers[0].buffers()[0]
        joined = k0._base if k0 is not None else None
        if joined is None or joined.dim() != 6 or joined.shape[4] < capacity_tokens or joined.dtype != like.dtype \
                or joined.device != layers[0].device or any(
                    layer.buffers()[i] is None or layer.buffers()[i].data_ptr() != joined[n, i].data_ptr()
                    for n, layer in enumerate(layers) for i in (0, 1)):
            b, h, _, d = like.shape
            joined = torch.empty((len(layers), 2, b, h, max(capacity_tokens, _MIN_CAPACITY_TOKENS), d),
                                 dtype=like.dtype, device=layers[0].device)
        for n, layer in enumerate(layers):
            layer.use_buffers(joined[n, 0], joined[n, 1])
        return joined

    def _initialize_layers(self) -> None:
        empty = torch.empty((1, self.layout.num_kv_heads, 0, self.layout.head_dim), dtype=self.layout_dtype,
                            device=self._compute_device())
        for layer in self.layers:
            if not layer.is_initialized:
                layer.lazy_initialization(empty, empty)

    def _fill_quantized(self, match) -> list[str]:
        """Quantized resident layers quantize whole groups as they take them (the rest stays exact):
        each layer takes the whole prefix at once."""
        blocks = KeptBlocks()
        with self.mover.restoring(match, blocks) as restored:  # the blocks stay valid inside the `with`
            device = self._compute_device()
            for layer_idx, layer in enumerate(self.layers if blocks else []):
                kv = [block[layer_idx].to(device=device, dtype=self.layout_dtype) for block in blocks]
                layer.extend(torch.cat([b[0] for b in kv], dim=1)[None], torch.cat([b[1] for b in kv], dim=1)[None])
        return restored.tiers

    @property
    def layout_dtype(self) -> torch.dtype:
        return getattr(torch, self.layout.dtype)

    def _compute_device(self) -> torch.device:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    def store(self, token_ids: torch.Tensor | list[int]) -> int:
        """Send the cache's new full blocks to the tiers; returns how many blocks were stored.

        `token_ids` are the tokens whose KV is in the cache (prompt + generated; the last generated
        token has no KV yet and is ignored by the block count).
        """
        if self.manager is None:
            return 0
        ids = token_ids.reshape(-1).tolist() if isinstance(token_ids, torch.Tensor) else list(token_ids)
        num_tokens = min(self.get_seq_length(), len(ids))
        block_tokens = self.layout.block_tokens
        num_full = num_tokens // block_tokens
        if num_full <= self._num_stored_blocks:
            return 0
        new = range(self._num_stored_blocks, num_full)
        chain = self.chain.extend(ids, num_full)
        self.mover.save(chain[new.start:], [self.block_tensor(i) for i in new], chains=[chain])  # the rest refreshed
        self.prefix.stored_blocks += len(new)
        self._num_stored_blocks = num_full
        return len(new)

    def block_tensor(self, block_idx: int) -> torch.Tensor:
        """The KV of one block, [L, 2, H, T, D], on the CPU (for a codec)."""
        start = block_idx * self.layout.block_tokens
        end = start + self.layout.block_tokens
        if self.quantized:
            per_layer = [torch.stack([kv[0] for kv in layer.token_range(start, end)]) for layer in self.layers]
        elif self.offload is not None:  # in a window or in host memory
            per_layer = [torch.stack(layer.block_kv(block_idx)) for layer in self.layers]
        else:
            per_layer = [torch.stack([layer.keys[0, :, start:end], layer.values[0, :, start:end]])
                         for layer in self.layers]
        return torch.stack(per_layer).cpu()


@dataclass(slots=True)
class _WindowSink:
    """The mover's sink for offloaded layers: block i of the prefix, every layer (`OffloadLayer.write_block`)."""

    layers: list[OffloadLayer]

    def write(self, index: int, block: torch.Tensor) -> None:
        for layer_idx, layer in enumerate(self.layers):
            layer.write_block(index, block[layer_idx, 0], block[layer_idx, 1])


def _layers(layout: KVLayout, resident_codec: str, offload: OffloadConfig | None,
            model: torch.nn.Module | None) -> list:
    num_layers = layout.num_layers
    if offload is not None:
        if resident_codec != "raw":
            raise ValueError(f"kv_offload attends to host blocks as they are: use resident_codec='raw' with it "
                             f"(got {resident_codec!r})")
        if offload.mode.kind == "sparse" and model is None:
            raise ValueError("sparse kv_offload picks blocks with each decode step's query: build the cache with "
                             "TieredCache.for_model(loaded, ...) or pass model=")
        tap = QueryTap.of(model) if offload.mode.kind == "sparse" else None
        return [OffloadLayer(offload, partial(tap.query, i) if tap else None) for i in range(num_layers)]
    if resident_codec == "raw":
        return [TieredLayer() for _ in range(num_layers)]
    from kvtier.levers.quantized_cache import QuantizedKVLayer, codec_quantizer

    quantizer = codec_quantizer(resident_codec)
    return [QuantizedKVLayer(quantizer) for _ in range(num_layers)]
