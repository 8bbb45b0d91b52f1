"""Block-window offload for `TieredCache` (issue 18): each layer holds its KV as the engine holds an
offloaded sequence's (`kvtier/offload/`), so a context larger than the device still decodes.

A layer keeps a *window* where the compute is — its first `sink_blocks` blocks (attention sinks) and its
last `recent_blocks` (the open block and the ones just before it): one device buffer of
(sink + recent) blocks, allocated at its first update — and every full block in between in host memory
(`kvtier.offload.host_kv.HostKV`: pinned when CUDA is present, block-major `[B, blocks, H, T, D]`, a run of
blocks one contiguous host -> device copy, one block one contiguous write; the staging and the sparse pick).
Which blocks are on the host follows the engine's rule: with n tokens in the context, logical blocks
[sink, max(sink, ceil(n / T) - recent)).

- `exact`: every update returns the whole context — sink, the host blocks copied to the device, the
  window's tail, the new tokens — the same K/V values `DynamicCache` returns, so attention and the
  greedy tokens are the same. On CUDA the next layer's host blocks are copied on a side stream
  (`stage`) while this layer computes.
- `sparse:BUDGET`: a one-token update (a decode step) scores the host *pages* (`page_tokens` tokens of a
  block, the engine's `offload_page_tokens`; the block when that is the block size) for each KV head with
  the step's query — per-channel key min/max (Quest) and mean per page (`page_summary`, on the device),
  `select_pages`: the engine's functions, imported, so the pick is the engine's — and returns [B, H, m, D]:
  the sink, each head's top `OffloadMode.num_fetched(n)` of its n host pages in context order (a head's K
  and V of a page are P x D contiguous in the host block: one copy each), the recent window. Each KV head
  attends to its own pages; that is valid because keys are
  cached after RoPE (a key's position travels with it) and a single query needs no causal mask.
  `get_mask_sizes` reports m for such a step, so the mask transformers builds has the keys' length
  (SDPA gets none for one unpadded query; eager gets m zeros). Multi-token updates (prefill chunks,
  a cue) are exact. One sequence per cache (batch size 1); `exact` takes any batch size.

transformers hands a cache only K and V (`past_key_values.update(k, v, layer_idx)`), computed right
after the query; `QueryTap` hooks the attention modules to get that query.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from functools import partial

import torch
from transformers.cache_utils import CacheLayerMixin

from kvtier.offload.config import OffloadConfig
from kvtier.offload.host_kv import HostKV


class OffloadLayer(CacheLayerMixin):
    """One layer: `keys`/`values` are the device window [B, H, (sink + recent) T, D] — tokens [0, sink T),
    then the tail, tokens [(sink + num_host_blocks) T, num_tokens) — and `host` its host blocks and their pages'
    summaries (`kvtier.offload.host_kv.HostKV`: storage, staging and the sparse pick live there)."""

    is_sliding = False

    def __init__(self, config: OffloadConfig, query: Callable[[], torch.Tensor] | None = None) -> None:
        super().__init__()
        mode = config.mode
        assert mode is not None, "an OffloadLayer offloads: its config has a mode"
        if mode.kind == "sparse" and query is None:
            raise ValueError("sparse kv_offload scores blocks with each decode step's query: give the layer one")
        self.config, self.mode = config, mode
        self.block_tokens, self.sink_blocks, self.recent_blocks = (config.block_tokens, config.sink_blocks,
                                                                   config.recent_blocks)
        # sparse's unit: pages of P tokens (exact: the block)
        self.page_tokens = config.page_tokens if mode.kind == "sparse" else config.block_tokens
        self.pages_per_block = self.block_tokens // self.page_tokens
        self.query = query
        self.num_tokens = 0
        self.host: HostKV | None = None  # made at the first update (its device and dtype are the model's)
        self.fetched_bytes = 0          # host -> device, every update
        self.decode_fetched_bytes = 0   # by one-token updates
        self.num_decode_steps = 0
        self.fetch_seconds = 0.0

    # -- the Cache layer API --------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        if self.mode.kind == "sparse" and b != 1:
            raise ValueError(f"sparse kv_offload picks blocks for one sequence (batch size 1), got a batch of {b}; "
                             "'exact' takes any batch size")
        window_tokens = (self.sink_blocks + self.recent_blocks) * self.block_tokens
        self.keys = torch.empty((b, h, window_tokens, d), dtype=self.dtype, device=self.device)
        self.values = torch.empty_like(self.keys)
        self.host = HostKV(self.block_tokens, self.page_tokens, self.mode.kind == "sparse", self.device, self.dtype)
        self.is_initialized = True

    @property
    def num_host_blocks(self) -> int:
        """Logical blocks sink_blocks .. sink_blocks + num_host_blocks - 1 are in host memory."""
        return self.host.num_blocks if self.host is not None else 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states [B, H, t, D] -> the K, V this step attends to, [B, H, m, D] on the device."""
        if not self.is_initialized or (self.num_tokens == 0 and self.keys.shape[0] != key_states.shape[0]):
            self.lazy_initialization(key_states, value_states)
        num_host_before = self.num_host_blocks
        tail_k, tail_v = self._append(key_states, value_states)
        decode = key_states.shape[-2] == 1
        self.num_decode_steps += decode
        if decode and self.mode.kind == "sparse":
            num_pages = self.num_host_blocks * self.pages_per_block
            num_fetched = self.mode.num_fetched(num_pages)
            if num_fetched < num_pages:
                return self._sparse(num_fetched)
        return self._whole(num_host_before, tail_k, tail_v, decode)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(keys the next update returns, 0): a sparse decode step returns fewer than the context."""
        num_tokens = self.num_tokens + query_length
        if query_length == 1 and self.mode.kind == "sparse":
            num_pages = (self._host_end(num_tokens) - self.sink_blocks) * self.pages_per_block
            num_tokens -= (num_pages - self.mode.num_fetched(num_pages)) * self.page_tokens
        return num_tokens, 0

    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        """Empty, keeping the window and host buffers for the next request."""
        self.num_tokens = self.num_decode_steps = 0
        self.fetched_bytes = self.decode_fetched_bytes = 0
        self.fetch_seconds = 0.0
        if self.host is not None:
            self.host.clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search (exact mode: batch > 1): the window and the host blocks follow their beams."""
        if self.num_tokens:
            self.keys = self.keys.index_select(0, beam_idx.to(self.device))
            self.values = self.values.index_select(0, beam_idx.to(self.device))
        if self.host is not None:
            self.host.reorder(beam_idx)

    # -- sizes ----------------------------------------------------------------------------------
    def _host_end(self, num_tokens: int) -> int:
        """The logical block after the last host block when the context holds `num_tokens` (the engine's
        window: the scheduler's `_window_chunk`, the eval's `SparseWindow.host_blocks`)."""
        return self.config.host_end(num_tokens)

    def nbytes(self) -> int:
        """Device KV: the window buffers (allocated whole at the first update)."""
        return self.keys.nbytes + self.values.nbytes if self.is_initialized else 0

    def host_bytes(self) -> int:
        return self.host.nbytes() if self.host is not None else 0

    def summary_bytes(self) -> int:
        return self.host.summary_bytes() if self.host is not None else 0

    # -- writing ----------------------------------------------------------------------------------
    def _append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write t new tokens: the sink first, then the tail; full blocks that leave the window go to
        host memory. Returns the tokens from the old tail's start on, [B, H, m, D] on the device (a view
        of the window when no block left: read it before the next update)."""
        t_block, sink = self.block_tokens, self.sink_blocks * self.block_tokens
        n = self.num_tokens
        fill = min(max(sink - n, 0), k.shape[-2])
        if fill:
            self.keys[:, :, n:n + fill] = k[:, :, :fill]
            self.values[:, :, n:n + fill] = v[:, :, :fill]
            k, v = k[:, :, fill:], v[:, :, fill:]
        tail = max(n - sink - self.num_host_blocks * t_block, 0)
        self.num_tokens = n + fill + k.shape[-2]
        leaving = self._host_end(self.num_tokens) - self.sink_blocks - self.num_host_blocks
        if leaving == 0:  # the tail keeps every new token (at most recent_blocks blocks)
            end = sink + tail + k.shape[-2]
            self.keys[:, :, sink + tail:end] = k
            self.values[:, :, sink + tail:end] = v
            return self.keys[:, :, sink:end], self.values[:, :, sink:end]
        tail_k = torch.cat([self.keys[:, :, sink:sink + tail], k], dim=2)
        tail_v = torch.cat([self.values[:, :, sink:sink + tail], v], dim=2)
        self._to_host(tail_k[:, :, :leaving * t_block], tail_v[:, :, :leaving * t_block])
        keep = tail_k.shape[2] - leaving * t_block
        self.keys[:, :, sink:sink + keep] = tail_k[:, :, leaving * t_block:]
        self.values[:, :, sink:sink + keep] = tail_v[:, :, leaving * t_block:]
        return tail_k, tail_v

    def _to_host(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, H, j T, D] (full blocks, on the device) -> the next j host blocks."""
        self.host.append(k, v)

    def reserve_host(self, num_blocks: int) -> None:
        """Room for `num_blocks` host blocks (and their summaries) without reallocating later."""
        b, h, _, d = self.keys.shape
        self.host.reserve(num_blocks, b, h, d)

    # -- prefix restore (TieredCache.load_prefix) -------------------------------------------------
    def write_block(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Restore block `index` ([H, T, D] each, batch row 0): sink blocks into the window, the others
        into host memory (after `reserve_host`); `restored` then settles the window."""
        if index < self.sink_blocks:
            start = index * self.block_tokens
            self.keys[0, :, start:start + self.block_tokens].copy_(k)
            self.values[0, :, start:start + self.block_tokens].copy_(v)
        else:
            self.host.write(index - self.sink_blocks, k, v)

    def restored(self, num_blocks: int) -> None:
        """`num_blocks` full blocks were written: the last ones move from host memory into the recent
        window, the host blocks get their pages' summaries."""
        t_block, sink = self.block_tokens, self.sink_blocks
        end = self._host_end(num_blocks * t_block)
        for block in range(end, num_blocks):
            start = (sink + block - end) * t_block
            k, v = self.host.block(block - sink)
            self.keys[0, :, start:start + t_block].copy_(k)
            self.values[0, :, start:start + t_block].copy_(v)
        self.num_tokens = num_blocks * t_block
        self.host.restored(end - sink)

    def block_kv(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full block `index` of batch row 0 (for the tiers): K, V [H, T, D], wherever it lives."""
        t_block, sink = self.block_tokens, self.sink_blocks
        if sink <= index < sink + self.num_host_blocks:
            return self.host.block(index - sink)
        start = (index if index < sink else index - self.num_host_blocks) * t_block
        return self.keys[0, :, start:start + t_block], self.values[0, :, start:start + t_block]

    # -- reading --------------------------------------------------------------------------------
    def stage(self, device: torch.device) -> None:
        """Start copying the host blocks to `device` (exact mode, on TieredCache's prefetch stream)."""
        if self.mode.kind == "exact" and self.host is not None:
            self.host.stage(device)

    def _whole(self, num_host: int, tail_k: torch.Tensor, tail_v: torch.Tensor, decode: bool):
        """The whole context: sink, host blocks [0, num_host), then the tail from its old start on."""
        sink = min(self.num_tokens, self.sink_blocks * self.block_tokens)
        if num_host == 0:
            return (torch.cat([self.keys[:, :, :sink], tail_k], dim=2),
                    torch.cat([self.values[:, :, :sink], tail_v], dim=2))
        host_k, host_v = self._fetch_host(num_host, decode)  # [B, n, H, T, D] on the device
        return self._joined(self.keys, host_k, tail_k), self._joined(self.values, host_v, tail_v)

    def _fetch_host(self, num_host: int, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        host_k, host_v = self.host.fetch(num_host)
        self._count(2 * host_k.nbytes, decode, time.perf_counter() - start)
        return host_k, host_v

    def _sparse(self, num_fetched: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: sink + each KV head's `num_fetched` best host pages + the tail, [1, H, m, D]."""
        n, h, d = self.num_host_blocks, self.keys.shape[1], self.keys.shape[-1]
        query = self.query()  # [1, Hq, 1, D], after RoPE
        sink, picked = self.sink_blocks * self.block_tokens, num_fetched * self.page_tokens
        tail_end = self.num_tokens - n * self.block_tokens
        out_k = self._around(self.keys, picked, self.keys[:, :, sink:tail_end])
        out_v = self._around(self.values, picked, self.values[:, :, sink:tail_end])
        start = time.perf_counter()
        self.host.pick(query[0, :, 0].reshape(h, -1, d), num_fetched, out_k[0, :, sink:sink + picked],
                       out_v[0, :, sink:sink + picked])  # gathered straight into its place
        self._count(2 * h * picked * d * out_k.element_size(), True, time.perf_counter() - start)
        return out_k, out_v

    def _joined(self, window: torch.Tensor, units: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """[window's sink | units [B, j, H, u, D] in order (host blocks) | tail] -> [B, H, m, D], one copy of each."""
        b, j, h, unit, d = units.shape
        sink = self.sink_blocks * self.block_tokens
        out = self._around(window, j * unit, tail)
        out[:, :, sink:sink + j * unit].unflatten(2, (j, unit)).copy_(units.transpose(1, 2))
        return out

    def _around(self, window: torch.Tensor, num_middle: int, tail: torch.Tensor) -> torch.Tensor:
        """[window's sink | `num_middle` tokens left to fill | tail] -> [B, H, m, D] (the sink and tail copied)."""
        b, h, _, d = window.shape
        sink = self.sink_blocks * self.block_tokens
        out = torch.empty((b, h, sink + num_middle + tail.shape[2], d), dtype=window.dtype, device=window.device)
        out[:, :, :sink] = window[:, :, :sink]
        out[:, :, sink + num_middle:] = tail
        return out

    def _count(self, num_bytes: int, decode: bool, seconds: float) -> None:
        self.fetched_bytes += num_bytes
        self.decode_fetched_bytes += num_bytes if decode else 0
        self.fetch_seconds += seconds


class QueryTap:
    """Each attention layer's query at a one-token step, after RoPE: what Quest scores blocks with.

    The tap hooks an attention module's query projection (its `q_norm` where it has one, else `q_proj`)
    and its rotary inputs (the `position_embeddings` it is called with), and rotates with the modeling
    file's own `apply_rotary_pos_emb`: the tensor the attention function is handed. One tap per model,
    its hooks left in place (they keep one token's query per layer, read once)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._queries: dict[int, torch.Tensor] = {}
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rotate: dict[int, Callable] = {}
        self._head_dim: dict[int, int] = {}
        for module in model.modules():
            source = getattr(module, "q_norm", None) or getattr(module, "q_proj", None)
            rotate = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
            layer_idx = getattr(module, "layer_idx", None)
            if source is None or rotate is None or layer_idx is None:
                continue
            self._rotate[layer_idx], self._head_dim[layer_idx] = rotate, module.head_dim
            module.register_forward_pre_hook(partial(self._on_attention, layer_idx), with_kwargs=True)
            source.register_forward_hook(partial(self._on_query, layer_idx))
        if not self._rotate:
            raise ValueError(f"sparse kv_offload needs the decode query: {type(model).__name__} has no attention "
                             "module with q_proj and a modeling file with apply_rotary_pos_emb")

    @classmethod
    def of(cls, model: torch.nn.Module) -> "QueryTap":
        tap = model.__dict__.get("_kvtier_query_tap")
        if tap is None:
            tap = model.__dict__["_kvtier_query_tap"] = cls(model)
        return tap

    def _on_attention(self, layer_idx: int, module, args, kwargs) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        rope = kwargs.get("position_embeddings")
        if hidden is not None and rope is not None and hidden.shape[1] == 1:
            self._rope[layer_idx] = rope  # (cos, sin); none seen: `query` says so

    def _on_query(self, layer_idx: int, module, args, output: torch.Tensor) -> None:
        if output.shape[1] == 1:  # [B, 1, Hq D] (q_proj) or [B, 1, Hq, D] (q_norm)
            self._queries[layer_idx] = output

    def query(self, layer_idx: int) -> torch.Tensor:
        """Layer `layer_idx`'s query of the running step, [B, Hq, 1, D] after RoPE."""
        try:
            q, (cos, sin) = self._queries.pop(layer_idx), self._rope.pop(layer_idx)
        except KeyError:
            raise RuntimeError(f"no decode query was seen for layer {layer_idx}: a sparse TieredCache decodes with "
                               "the model it was built for (TieredCache.for_model)") from None
        q = q.reshape(q.shape[0], 1, -1, self._head_dim[layer_idx]).transpose(1, 2)
        return self._rotate[layer_idx](q, q, cos, sin)[0]
