"""The device KV arena: the engine's whole KV budget as fixed-size block slots, raw or quantized.

`make_arena(layout, budget, codec)` picks the format resident on the device:

- "raw": K and V at the model's dtype, `[L, num_blocks, H, T, D]` each (exact; the default).
- "fp8" / "int8": every token quantized as it is written, K and V per token and head (one fp32
  scale for fp8 e4m3; an fp16 scale and min for int8) — vLLM's `kv_cache_dtype=fp8` idea.
- "int4" / "int2": KIVI. Values per token (groups of 64 channels), keys per channel over the
  block's `T` tokens, so a block can only be quantized once it is full: the open (last, partial)
  block of each sequence stays at full precision in a staging buffer — KIVI's residual, one block
  long — and is sealed into the arena when its last token is written. The budget reserves room for
  `max_num_seqs` such open blocks.

One class per format: `RawArena`, `PerTokenArena` (fp8, int8), `KiviArena` (int4, int2); the
quantized two share `QuantArena` (parts, plan, whole blocks) and `TokenQuantizer` (per-token
layout). The quantizers are `kvtier.codecs.quant`'s; the arena only lays their codes and scales
out in block slots. Every arena offers the same operations to the runner and the attention:
`write` the new tokens of a step, `gather` a sequence's context at full precision, `end_step`,
and whole-block copies for the tiers (`block_tensor`/`write_block`, full precision).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvtier.blocks import KVLayout
from kvtier.codecs import quant
from kvtier.codecs.codec import byte_array
from kvtier.config import ARENA_CODECS, KVFormat

if TYPE_CHECKING:
    from kvtier.transfer.copies import CopyGroup

_KIVI_GROUP = quant.DEFAULT_GROUP_SIZE


def arena_block_bytes(layout: KVLayout, codec: str) -> int:
    """Bytes one block slot takes in an arena of this codec (codes + scales, all layers, K and V)."""
    if codec == "raw":
        return layout.block_bytes
    h, t, d, num_layers = layout.num_kv_heads, layout.block_tokens, layout.head_dim, layout.num_layers
    return num_layers * h * sum(math.prod(shape) * dtype.itemsize for shape, dtype in _parts(codec, h, t, d).values())


def make_arena(layout: KVLayout, budget_bytes: int, codec: KVFormat = "raw", *, device: torch.device | str = "cpu",
               max_open_blocks: int = 0) -> "Arena":
    """The arena that fits `budget_bytes`; KIVI codecs first reserve `max_open_blocks` open blocks."""
    if codec not in ARENA_CODECS:
        raise ValueError(f"unknown device KV format {codec!r}: use one of {', '.join(ARENA_CODECS)}")
    device = torch.device(device)
    if codec == "raw":
        return RawArena(layout, budget_bytes // layout.block_bytes, device)
    reserved = max_open_blocks * layout.block_bytes if codec in ("int4", "int2") else 0
    if reserved >= budget_bytes:
        raise ValueError(f"a {budget_bytes:,}-byte device KV budget cannot hold the {max_open_blocks} full-precision "
                         f"open blocks {codec} keeps (one per running sequence, {layout.block_bytes:,} bytes "
                         "each): lower max_num_seqs or block_tokens, or raise the budget")
    num_blocks = (budget_bytes - reserved) // arena_block_bytes(layout, codec)
    arena_cls = KiviArena if codec in ("int4", "int2") else PerTokenArena
    return arena_cls(layout, num_blocks, device, codec, reserved)


def _parts(codec: str, h: int, t: int, d: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """A quantized arena's tensors, name -> (shape per KV head and block, dtype). Each is allocated
    `[L, H, num_blocks, *shape]` (head-major: a sequence's blocks gather straight into [H, tokens, ...])."""
    if codec == "fp8":
        half = {"codes": ((t, d), torch.float8_e4m3fn), "scale": ((t, 1), torch.float32)}
        return {f"{kv}_{name}": spec for kv in "kv" for name, spec in half.items()}
    bits = int(codec[3:])
    if codec == "int8":
        half = {"codes": ((t, d), torch.uint8), "scale": ((t, 1), torch.float16), "zero": ((t, 1), torch.float16)}
        return {f"{kv}_{name}": spec for kv in "kv" for name, spec in half.items()}
    group = _value_group(codec, d)
    groups = -(-d // group)  # a head_dim that is not a multiple of the group is padded to whole groups
    return {
        # keys per channel over the block's tokens: the codes of [T, D] in order, bit-packed
        "k_codes": ((quant.packed_bytes(t * d, bits),), torch.uint8),
        "k_scale": ((1, d), torch.float16), "k_zero": ((1, d), torch.float16),
        # values per token, groups of 64 channels
        "v_codes": ((t, quant.packed_bytes(groups * group, bits)), torch.uint8),
        "v_scale": ((t, groups), torch.float16), "v_zero": ((t, groups), torch.float16),
    }


def _value_group(codec: str, d: int) -> int:
    """Channels per value scale: the whole head for fp8/int8, KIVI's groups of (at most) 64 for int4/int2."""
    return min(_KIVI_GROUP, d) if codec in ("int4", "int2") else d


class RawArena:
    """K and V at the model's dtype. `gather` is one `index_select` per tensor."""

    codec = "raw"
    reserved_bytes = 0
    # write_block touches only the block's own slots: the transfer worker may write a loading
    # sequence's blocks while a forward reads others
    block_writes_off_thread = True

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout, self.num_blocks, self.device = layout, num_blocks, device
        self.dtype = getattr(torch, layout.dtype)
        shape = (layout.num_layers, num_blocks, layout.num_kv_heads, layout.block_tokens, layout.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=device)
        if self.k_cache.device.type == "cpu":  # byte views for write_block's memcpy
            self._k_bytes = byte_array(self.k_cache)
            self._v_bytes = byte_array(self.v_cache)

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def nbytes(self) -> int:
        """Device bytes the arena holds (allocated once)."""
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def context_index(self, block_table: torch.Tensor, context_tokens: int,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """Row (h, p) of a layer's `[num_blocks * H * T, D]` view for every head h and position p
        (p < context_tokens, or the given `positions`: an offloaded sequence's device window)."""
        h, t = self.layout.num_kv_heads, self.layout.block_tokens
        pos = torch.arange(context_tokens, device=block_table.device) if positions is None else positions
        blocks = block_table[pos // t]
        heads = torch.arange(h, device=block_table.device)[:, None]
        return ((blocks[None, :] * h + heads) * t + pos % t).reshape(-1)

    def write(self, layer: int, block_ids: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """keys/values: [N, H, D], token i going to slot (block_ids[i], offsets[i])."""
        self.k_cache[layer][block_ids, :, offsets] = keys
        self.v_cache[layer][block_ids, :, offsets] = values

    def gather(self, layer: int, seq) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(first query row, end row, keys, values) groups of `seq` (a `SeqSlice`); keys and values are
        [H, context of the group's last query, D]. Raw: one group, one `index_select` each."""
        h, d = self.layout.num_kv_heads, self.layout.head_dim
        k = self.k_cache[layer].view(-1, d).index_select(0, seq.index).view(h, seq.context_tokens, d)
        v = self.v_cache[layer].view(-1, d).index_select(0, seq.index).view(h, seq.context_tokens, d)
        return [(0, seq.q_end - seq.q_start, k, v)]

    def begin_step(self, seqs: list) -> None:
        pass

    def paged_table(self, block_table: torch.Tensor) -> torch.Tensor:
        """The step's block table [S, max blocks] as block indices of `paged_kv` (raw: the arena's own)."""
        return block_table

    def paged_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values as a paged kernel reads them in place: [num_blocks, H, T, D] each."""
        return self.k_cache[layer], self.v_cache[layer]

    def end_step(self) -> None:
        pass

    def prune(self, is_live) -> None:
        pass

    def block_tensor(self, block_id: int) -> torch.Tensor:
        """One full block at the model's dtype, [L, 2, H, T, D] on the CPU (for a tier codec)."""
        return torch.stack([self.k_cache[:, block_id], self.v_cache[:, block_id]], dim=1).cpu()

    def write_block(self, block_id: int, kv: torch.Tensor, copies: CopyGroup | None = None) -> None:
        """One decoded block [L, 2, H, T, D] into its slots. On the CPU plain numpy memcpys over all its
        layers, K and V each cut into one copy per thread of `copies` (the transfer worker's group: one
        thread beside a forward, whose intra-op threads use every core, more when none runs; None: copied
        now)."""
        if self.device.type == kv.device.type == "cpu" and kv.dtype == self.dtype and kv.is_contiguous():
            src = byte_array(kv)
            if copies is None or copies.threads == 1:
                self._k_bytes[:, block_id] = src[:, 0]
                self._v_bytes[:, block_id] = src[:, 1]
                return
            copies.add_split(self._k_bytes[:, block_id], src[:, 0])  # a few copies over the layers
            copies.add_split(self._v_bytes[:, block_id], src[:, 1])
            return
        kv = kv.to(device=self.device, dtype=self.dtype)
        self.k_cache[:, block_id] = kv[:, 0]
        self.v_cache[:, block_id] = kv[:, 1]


class TokenQuantizer:
    """How a per-token format lays tokens out in an arena's parts: fp8 (one fp32 scale per token and
    head) or int8 / KIVI values (an fp16 scale and min per token, head and channel group)."""

    def __init__(self, codec: str, head_dim: int) -> None:
        self.fp8 = codec == "fp8"
        self.bits = None if self.fp8 else int(codec[3:])
        self.group = _value_group(codec, head_dim)

    def store(self, parts: dict[str, torch.Tensor], kv: str, layer: int, block_ids: torch.Tensor,
              offsets: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize tokens x [N, H, D] per token (and channel group) into their slots."""
        x = x.transpose(0, 1)  # [H, N, D]: the parts' order
        h, n, _ = x.shape
        if self.fp8:
            q = quant.quantize_fp8(x)
            parts[f"{kv}_codes"][layer][:, block_ids, offsets] = q.data
            parts[f"{kv}_scale"][layer][:, block_ids, offsets] = q.scale
            return
        q = quant.quantize_groups(x, self.bits, -1, self.group)
        parts[f"{kv}_codes"][layer][:, block_ids, offsets] = q.data.view(h, n, -1)
        parts[f"{kv}_scale"][layer][:, block_ids, offsets] = q.scale.view(h, n, -1)
        parts[f"{kv}_zero"][layer][:, block_ids, offsets] = q.zero.view(h, n, -1)

    def load(self, parts: dict[str, torch.Tensor], kv: str, layer: int, index: torch.Tensor,
             shape: tuple[int, int, int], dtype: torch.dtype) -> torch.Tensor:
        """[H, n × T, D] at `dtype` for the n blocks in `index` (shape = (H, T, D))."""
        h, t, d = shape
        n = index.numel()
        codes = parts[f"{kv}_codes"][layer].index_select(1, index)
        scale = parts[f"{kv}_scale"][layer].index_select(1, index)
        if self.fp8:
            return quant.dequantize(quant.Fp8Tensor(codes.view(h, n * t, d), scale.view(h, n * t, 1), dtype))
        zero = parts[f"{kv}_zero"][layer].index_select(1, index)
        groups = -(-d // self.group)  # groups of `group` channels: grouped [H, n T, D / group, group]
        q = quant.QuantizedTensor(codes.reshape(-1), scale.view(h, n * t, groups, 1), zero.view(h, n * t, groups, 1),
                                  self.bits, -1, self.group, (h, n * t, d), dtype)
        return quant.dequantize(q)


class QuantArena:
    """What the quantized formats share: parts `[L, H, num_blocks, ...]` (head-major, so a sequence's
    blocks gather with one `index_select` on the block axis straight into `[H, blocks × T, ...]`),
    the step's plan (the union of blocks read, dequantized once per layer), and full-precision whole
    blocks for the tiers. A format says how it writes tokens (`write`), which
    of a sequence's blocks are read dequantized (`_planned`), how queries group (`_groups`), and how a
    whole block is stored (`write_block`) and read back (`_dequantize`)."""

    # write_block also updates the format's step state (KIVI's staging): the step thread writes blocks
    block_writes_off_thread = False

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device, codec: str,
                 reserved_bytes: int = 0) -> None:
        self.layout, self.num_blocks, self.device, self.codec = layout, num_blocks, device, codec
        self.reserved_bytes = reserved_bytes
        self.dtype = getattr(torch, layout.dtype)
        h, t, d = layout.num_kv_heads, layout.block_tokens, layout.head_dim
        self.tokens = TokenQuantizer(codec, d)
        self.parts = {name: torch.zeros((layout.num_layers, h, num_blocks, *shape), dtype=dtype, device=device)
                      for name, (shape, dtype) in _parts(codec, h, t, d).items()}
        # KIVI's open blocks, block id -> per layer [2, H, T, D] (see KiviArena); always empty per token
        self.staging: dict[int, list[torch.Tensor | None]] = {}
        self._plan: tuple[torch.Tensor, dict[int, tuple]] | None = None  # see begin_step
        self._decoded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}       # layer -> the union, decoded

    @property
    def block_bytes(self) -> int:
        return arena_block_bytes(self.layout, self.codec)

    @property
    def nbytes(self) -> int:
        """Device bytes the arena holds: its parts, and the full-precision open blocks it reserves."""
        return sum(p.numel() * p.element_size() for p in self.parts.values()) + self.reserved_bytes

    def context_index(self, block_table: torch.Tensor, context_tokens: int) -> torch.Tensor:
        return block_table

    # -- the step's reads --------------------------------------------------------------------------
    def begin_step(self, seqs: list) -> None:
        """A new step: the gathers of `seqs` are planned."""
        self._make_plan(seqs)

    def _planned(self, ids: list[int], context_tokens: int) -> list[int]:
        """The blocks of a sequence's table read dequantized from the arena."""
        return ids

    def _make_plan(self, seqs: list) -> None:
        """The union of the blocks the sequences read dequantized (decoded once per layer, not once per
        sequence), in first-use order, and where each sequence's blocks sit in it — a token range when
        they are consecutive there (no copy: the usual case), else row indices."""
        t = self.layout.block_tokens
        slot: dict[int, int] = {}
        rows = {}
        for seq in seqs:
            ids = seq.index.tolist()
            table = self._planned(ids, seq.context_tokens)
            for b in table:
                slot.setdefault(b, len(slot))
            slots = [slot[b] for b in table]
            first = slots[0] if slots else 0
            if slots == list(range(first, first + len(slots))):
                where = (first * t, len(slots) * t)
            else:
                blocks = torch.tensor(slots, dtype=torch.long)
                where = (blocks[:, None] * t + torch.arange(t)).reshape(-1).to(self.device)
            # the plan holds `seq` itself, so its id cannot be reused by another object during the step
            rows[id(seq)] = (seq, where, ids)
        self._plan = (torch.tensor(list(slot), dtype=torch.long, device=self.device), rows)
        self._decoded = {}

    def gather(self, layer: int, seq) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
        """(first query row, end row, keys, values) groups of `seq` (a `SeqSlice`); keys and values are
        [H, context of the group's last query, D] at full precision."""
        if self._plan is None or self._plan[1].get(id(seq), (None,))[0] is not seq:
            self._make_plan([seq])  # a gather outside the step's plan (tests, tools)
        k_union, v_union = self._union(layer)  # after this layer's writes: this step's tokens included
        _, where, ids = self._plan[1][id(seq)]
        if isinstance(where, tuple):  # [H, blocks × T, D]
            k_full, v_full = k_union.narrow(1, *where), v_union.narrow(1, *where)
        else:
            k_full, v_full = k_union.index_select(1, where), v_union.index_select(1, where)
        return self._groups(layer, seq, ids, k_full, v_full)

    def _groups(self, layer: int, seq, ids: list[int], k_full: torch.Tensor, v_full: torch.Tensor) -> list:
        return [(0, seq.q_end - seq.q_start, k_full[:, :seq.context_tokens], v_full[:, :seq.context_tokens])]

    def _union(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's planned blocks of a layer dequantized, [H, n x T, D] each (once per layer, after its write)."""
        if layer not in self._decoded:
            union = self._plan[0]
            self._decoded[layer] = (self._dequantize("k", layer, union), self._dequantize("v", layer, union))
        return self._decoded[layer]

    def paged_table(self, block_table: torch.Tensor) -> torch.Tensor:
        """The step's block table [S, max blocks] as indices of `paged_kv`: each block's place in the step's
        dequantized union (the plan's; padding maps anywhere: never read)."""
        union = self._plan[0]
        place = torch.zeros(self.num_blocks, dtype=torch.long, device=self.device)
        place[union] = torch.arange(union.numel(), device=self.device)
        return place[block_table]

    def paged_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's planned blocks of a layer at full precision, as [n, H, T, D] views of the decoded union
        (dequantized once per layer, as the gathers are): a paged kernel reads them through `paged_table`."""
        h, t, d = self._block_half()
        k, v = self._union(layer)
        n = k.shape[1] // t
        return tuple(x.as_strided((n, h, t, d), (t * d, x.stride(0), d, 1)) for x in (k.contiguous(), v.contiguous()))

    def end_step(self) -> None:
        self._plan, self._decoded = None, {}

    def prune(self, is_live) -> None:
        pass

    # -- whole blocks ------------------------------------------------------------------------------
    def block_tensor(self, block_id: int) -> torch.Tensor:
        """One full block dequantized to the model's dtype, [L, 2, H, T, D] on the CPU."""
        index = torch.tensor([block_id], dtype=torch.long, device=self.device)
        layers = [torch.stack([self._dequantize("k", layer, index), self._dequantize("v", layer, index)])
                  for layer in range(self.layout.num_layers)]
        return torch.stack(layers).cpu()

    def _block_half(self) -> tuple[int, int, int]:
        return self.layout.num_kv_heads, self.layout.block_tokens, self.layout.head_dim

    def _dequantize(self, kv: str, layer: int, index: torch.Tensor) -> torch.Tensor:
        """[H, n × T, D] at the model's dtype for the n blocks in `index`, in that order."""
        if index.numel() == 0:
            h, _, d = self._block_half()
            return torch.empty((h, 0, d), dtype=self.dtype, device=self.device)
        return self.tokens.load(self.parts, kv, layer, index, self._block_half(), self.dtype)


class PerTokenArena(QuantArena):
    """fp8 / int8: every token quantized as it is written, K and V per token and head; a gather is
    one group, the whole context dequantized (this step's tokens too)."""

    def write(self, layer: int, block_ids: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        self._decoded.pop(layer, None)
        for kv, x in (("k", keys), ("v", values)):
            self.tokens.store(self.parts, kv, layer, block_ids, offsets, x)

    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        """Quantize one full block (a decoded tier block, [L, 2, H, T, D]) into its slot."""
        kv = kv.to(device=self.device, dtype=self.dtype)
        t = self.layout.block_tokens
        ids = torch.full((t,), block_id, dtype=torch.long, device=self.device)
        offsets = torch.arange(t, device=self.device)
        for layer in range(self.layout.num_layers):
            for i, kv_name in enumerate("kv"):
                self.tokens.store(self.parts, kv_name, layer, ids, offsets, kv[layer, i].transpose(0, 1))


class KiviArena(QuantArena):
    """KIVI int4 / int2: values per token (groups of 64 channels), keys per channel over the block's
    T tokens — so a block is quantized ("sealed") only once it is full. The open block of a sequence
    stays exact in `staging`; queries in block j attend to blocks < j dequantized and to block j
    exact, one group per block, so a token sees the same KV however its prefill was chunked."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device, codec: str,
                 reserved_bytes: int = 0) -> None:
        super().__init__(layout, num_blocks, device, codec, reserved_bytes)
        self.bits = int(codec[3:])
        d = layout.head_dim
        if d * self.bits % 8 or self.tokens.group * self.bits % 8:
            raise ValueError(f"{codec} needs head_dim * bits to be whole bytes (head_dim {d})")
        # a block filled within a step keeps only the layer being computed: the transient cost of a
        # prefill chunk is one layer of its blocks, not all of them
        self._sealing: set[int] = set()

    def write(self, layer: int, block_ids: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        self._decoded.pop(layer, None)
        t = self.layout.block_tokens
        ids = block_ids.tolist()
        touched = list(dict.fromkeys(ids))
        if layer > 0:  # blocks sealed this step: the previous layer's gathers are done, its exact copy is not needed
            for block_id in self._sealing:
                self.staging[block_id][layer - 1] = None
        for block_id in touched:
            layers = self.staging.setdefault(block_id, [None] * self.layout.num_layers)
            if layers[layer] is None:
                layers[layer] = torch.empty((2, *self._block_half()), dtype=self.dtype, device=self.device)
        # a step writes each sequence's tokens as one run of consecutive offsets per block: one slice copy each
        offs = offsets.tolist()
        start = 0
        while start < len(ids):
            end = start + 1
            while end < len(ids) and ids[end] == ids[start] and offs[end] == offs[end - 1] + 1:
                end += 1
            staged, first = self.staging[ids[start]][layer], offs[start]
            staged[0, :, first:first + end - start] = keys[start:end].transpose(0, 1)
            staged[1, :, first:first + end - start] = values[start:end].transpose(0, 1)
            if offs[end - 1] == t - 1:
                self._sealing.add(ids[start])
            start = end
        full = [b for b in touched if b in self._sealing]
        if full:
            self._seal(layer, full, torch.stack([self.staging[b][layer] for b in full]))

    def begin_step(self, seqs: list) -> None:
        """Nothing is being sealed (a step that failed half-way left no end_step); plan the gathers."""
        self._sealing.clear()
        super().begin_step(seqs)

    def _planned(self, ids: list[int], context_tokens: int) -> list[int]:
        return ids[:(context_tokens - 1) // self.layout.block_tokens]  # the last block is read exact

    def _groups(self, layer: int, seq, ids: list[int], k_full: torch.Tensor, v_full: torch.Tensor) -> list:
        t, context = self.layout.block_tokens, seq.context_tokens
        first = context - (seq.q_end - seq.q_start)   # position of the first query
        groups = []
        for j in range(first // t, (context - 1) // t + 1):
            lo, hi = max(first, j * t), min(context, (j + 1) * t)
            layers = self.staging.get(ids[j])
            staged = layers[layer] if layers is not None else None
            if staged is None:  # a block not written this step (not the engine's case): its stored form
                own_k, own_v = (self._dequantize(kv, layer, seq.index[j:j + 1]) for kv in "kv")
            else:
                own_k, own_v = staged[0], staged[1]
            k = torch.cat([k_full[:, :j * t], own_k[:, :hi - j * t]], dim=1)
            v = torch.cat([v_full[:, :j * t], own_v[:, :hi - j * t]], dim=1)
            groups.append((lo - first, hi - first, k, v))
        return groups

    def end_step(self) -> None:
        """Every layer of the blocks filled this step is sealed: drop their staging."""
        super().end_step()
        for block_id in self._sealing:
            self.staging.pop(block_id, None)
        self._sealing.clear()

    def prune(self, is_live) -> None:
        """Drop the staging of open blocks no sequence holds any more (finished or preempted)."""
        for block_id in [b for b in self.staging if not is_live(b)]:
            del self.staging[block_id]

    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        """Seal one full block (a decoded tier block, [L, 2, H, T, D]) into its slot."""
        kv = kv.to(device=self.device, dtype=self.dtype)
        self.staging.pop(block_id, None)
        for layer in range(self.layout.num_layers):
            self._seal(layer, [block_id], kv[layer][None])

    def _seal(self, layer: int, block_ids: list[int], kv: torch.Tensor) -> None:
        """Quantize full blocks kv [n, 2, H, T, D] of one layer into their slots."""
        n, _, h, t, d = kv.shape
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        q = quant.quantize_groups(kv[:, 0].transpose(0, 1), self.bits, -2, t)  # [H, n, T, D], per channel
        self.parts["k_codes"][layer][:, index] = q.data.view(h, n, -1)
        self.parts["k_scale"][layer][:, index] = q.scale.view(h, n, 1, d)
        self.parts["k_zero"][layer][:, index] = q.zero.view(h, n, 1, d)
        values = kv[:, 1].transpose(1, 2).reshape(n * t, h, d)  # [n*T, H, D], token-major like a write
        rows = index.repeat_interleave(t)
        self.tokens.store(self.parts, "v", layer, rows, torch.arange(t, device=self.device).repeat(n), values)

    def _dequantize(self, kv: str, layer: int, index: torch.Tensor) -> torch.Tensor:
        if kv == "v" or index.numel() == 0:
            return super()._dequantize(kv, layer, index)
        h, t, d = self._block_half()  # keys per channel over each block's T tokens: grouped [H, n, 1, T, D]
        n = index.numel()
        codes = self.parts["k_codes"][layer].index_select(1, index)
        scale = self.parts["k_scale"][layer].index_select(1, index)
        zero = self.parts["k_zero"][layer].index_select(1, index)
        q = quant.QuantizedTensor(codes.reshape(-1), scale.view(h, n, 1, 1, d), zero.view(h, n, 1, 1, d),
                                  self.bits, -2, t, (h, n, t, d), self.dtype)
        return quant.dequantize(q).view(h, n * t, d)


Arena = RawArena | PerTokenArena | KiviArena
