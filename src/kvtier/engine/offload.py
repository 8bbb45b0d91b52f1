"""Contexts larger than the device: the live KV of a long sequence, its cold blocks in host memory.

A sequence whose prompt + max_tokens is more than the device budget holds (issue 18) keeps only a
*window* of its blocks in the device arena: the first `sink_blocks` (attention sinks, StreamingLLM)
and the last `recent_blocks` (the block being written and the ones just before it). Every full
block between them lives in host memory — a pinned slot of the DRAM tier (`TierManager.pin_host`:
one host memory, the same slots prefix caching uses; a block written through when it was computed
is pinned where it already is, checked by its key-bound header). Attention over the middle runs
from a fixed *fetch area* on the device (counted in the device budget, two halves):

- `exact`: every host block of the sequence, layer by layer, in pieces of half the fetch area; a
  background thread fetches piece i + 1 (the next layer's, or the next sequence's) while piece i is
  attended to (on CUDA: issues its copies on a side stream, see `FetchArea`). Output is the attention
  over the whole context: the pieces are merged by their log-sum-exp (FlashAttention's merge), the
  device window with its causal mask.
- `sparse` (a budget in pages, or a fraction of the host pages): a host block of T tokens is T / P pages
  of P tokens (`EngineConfig.offload_page_tokens`; P = T: a page is the block). At each decode step and
  layer, a per-page summary kept on the device (per-channel min, max and mean of the page's keys) scores
  the host pages for each KV head: half Quest's bound of q.k over the page (min/max: no key of it scores
  more), half q . its mean key (`quest_scores`, `BOUND_WEIGHT`), the max over its group's query heads; only
  the top pages of each head are fetched (a head's K and V of a page are P x D contiguous in the slot: one
  copy each). Prefill chunks are always exact. The pick is made on the device
  and the copies are issued by the host, so on CUDA a sparse layer reads its selection back (one sync per
  layer and sequence) and copies on the compute stream: not overlapped.

A request whose prompt is cached starts where that computation would have left it: its sink blocks on
the device, its middle blocks held in DRAM slots. One lookup at admission finds both
(`Scheduler._reuse_offloaded_prefix`); the transfer worker loads the sink blocks into the device and
then holds the middle ones (`BlockMover.pin_in_host`): pinned where the DRAM tier holds them (no copy:
the blocks an earlier request wrote through), read once from a lower tier (SSD, a pool) otherwise,
verified by their payload checksums, stored into DRAM slots (not written back down) and pinned there.
The sequence waits in WAITING_FOR_KV meanwhile; the step thread never reads a tier.

Blocks move host -> device only; a host block never changes (it is full), so nothing moves back.
Summaries (2 x head_dim values per layer, KV head and page) are device memory too, reported
apart from the KV (`OffloadStats.summary_bytes`). On the CPU the fetch thread copies with numpy
memcpys. On CUDA the same thread issues `non_blocking` copies from the pinned DRAM slots on a side stream:
piece i + 1's copy of layer l + 1 runs while the compute stream attends over piece i, ordered by CUDA
events both ways (a half is never written while attention still reads it; attention never reads a half
before its copy landed), with no host sync on the way. That CUDA path was written without a GPU to run
it: `make gpu-check` runs its tests (tests/engine/test_offload.py -k cuda) when one is there.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvtier.codecs.codec import byte_array
from kvtier.config import OffloadMode, parse_offload  # noqa: F401 — the modes are configuration (torch-free)

@dataclass(slots=True)
class OffloadStats:
    """One offloaded request: what its long context cost the device and the host link."""

    mode: str = ""
    peak_device_kv_bytes: int = 0   # its device window (blocks in the arena) at its largest
    host_kv_bytes: int = 0          # its KV in host memory now (at the end: at its largest)
    summary_bytes: int = 0          # its block summaries on the device (sparse)
    fetched_bytes: int = 0          # host -> device, all steps
    fetch_seconds: float = 0.0      # waiting for fetches on the step thread (not hidden by compute; on CUDA
                                    # the host's wait for copies to be issued, not the device's for them)
    num_decode_tokens: int = 0
    decode_fetched_bytes: int = 0   # fetched by decode steps (for bytes per decode token)

    @property
    def fetched_bytes_per_token(self) -> float:
        return self.decode_fetched_bytes / self.num_decode_tokens if self.num_decode_tokens else 0.0

    def to_dict(self) -> dict:
        return {"mode": self.mode, "peak_device_kv_bytes": self.peak_device_kv_bytes,
                "host_kv_bytes": self.host_kv_bytes, "summary_bytes": self.summary_bytes,
                "fetched_bytes": self.fetched_bytes, "fetched_bytes_per_decode_token": self.fetched_bytes_per_token,
                "fetch_seconds": self.fetch_seconds}


@dataclass(slots=True)
class HostBlocks:
    """A sequence's blocks in host memory: logical blocks sink_blocks .. sink_blocks + len - 1."""

    mode: OffloadMode
    reserved_blocks: int                  # host slots set aside for it at admission (its longest need)
    slots: list[int] = field(default_factory=list)    # the DRAM slot of each (pinned)
    keys: list[bytes] = field(default_factory=list)
    summaries: torch.Tensor | None = None  # [capacity, L, pages, H, 3, D] key min / max / mean per page (sparse)
    stats: OffloadStats = field(default_factory=OffloadStats)

    def __len__(self) -> int:
        return len(self.slots)


@dataclass(slots=True)
class SeqOffload:
    """What the attention needs of one offloaded sequence in this step (built by the runner)."""

    mode: OffloadMode
    slots: torch.Tensor            # [n] long: the host slots of its middle blocks, in order
    summaries: torch.Tensor | None  # [n, L, pages, H, 3, D]
    q_positions: torch.Tensor      # [num queries] positions of this step's tokens
    key_positions: torch.Tensor    # [device context] positions of the keys `arena.gather` returns
    decode: bool                   # one query: sparse applies (prefill chunks are exact)
    stats: OffloadStats


def window_positions(block_ids: list[int], block_tokens: int, end: int) -> list[int]:
    """Positions (< end) of the tokens in device blocks (block id >= 0) of a block table."""
    positions: list[int] = []
    for i, block_id in enumerate(block_ids):
        if block_id >= 0 and i * block_tokens < end:
            positions += range(i * block_tokens, min((i + 1) * block_tokens, end))
    return positions


# a page's score: this much of Quest's bound, the rest the query against the page's mean key
# (docs/benchmarks/quality.md, issue 18: over 3 windows at sparse:1/8, Quest's bound alone +2.44% ppl at 4k /
# +2.29% at 8k, the mean alone +2.77 / +2.30%, half and half +1.93 / +0.91% — an oracle ranking pages by
# attention mass +1.51 / +0.98%)
BOUND_WEIGHT = 0.5


def page_summary(k_block: torch.Tensor, page_tokens: int) -> torch.Tensor:
    """k_block [L, H, T, D] -> [L, T / P, H, 3, D]: per-channel min, max (Quest's box) and mean over each page
    of P tokens (`config.PAGE_SUMMARY_VECTORS` vectors)."""
    l, h, t, d = k_block.shape
    pages = k_block.reshape(l, h, t // page_tokens, page_tokens, d).transpose(1, 2)  # [L, pages, H, P, D]
    return torch.stack([pages.amin(dim=3), pages.amax(dim=3), pages.mean(dim=3)], dim=3)


def quest_scores(summary: torch.Tensor, q: torch.Tensor, bound_weight: float = BOUND_WEIGHT) -> torch.Tensor:
    """Each page's score: summary [n, H, 3, D] (key min, max, mean), q [H, G, D] (a KV head's group of query
    heads, one query) -> [n, H], for each KV head the largest in its group of
    `bound_weight` x Quest's bound of q.k over the page (the most any of its keys can score)
    + (1 - bound_weight) x q . its mean key (what its keys score on average)."""
    bound = torch.maximum(q[None] * summary[:, :, None, 0], q[None] * summary[:, :, None, 1]).sum(-1)  # [n, H, G]
    if bound_weight != 1.0:
        mean = (q[None] * summary[:, :, None, 2]).sum(-1)
        bound = bound_weight * bound + (1.0 - bound_weight) * mean
    return bound.amax(-1)


def select_blocks(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best of each KV head, scores [n, H] -> indices [k, H] in context order."""
    return scores.topk(k, dim=0).indices.sort(dim=0).values


def select_pages(summaries: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """The pick over n blocks' pages: summaries [n, pages, H, 3, D] (`page_summary` of each block),
    q [H, G, D] -> the k best pages of each KV head [k, H] in context order, as block * pages + page."""
    n, pages = summaries.shape[:2]
    return select_blocks(quest_scores(summaries.reshape(n * pages, *summaries.shape[2:]), q), k)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [H, G, N, D] (G query heads per KV head) over k, v [H, M, D], with its
    log-sum-exp: (out [H, G, N, D], lse [H, G, N]). `mask` [N, M]: True where a key may be seen.
    On the CPU the fused flash kernel SDPA itself runs, which also returns the log-sum-exp: 3.5x the
    speed of the two GEMMs around a materialized softmax for a 128-token prefill chunk over a 960-token
    piece, 1.5x for one decode token (docs/benchmarks/long-context.md, "The offloaded prefill on the CPU flash
    kernel")."""
    if q.device.type == "cpu":
        return _attend_flash_cpu(q, k, v, mask, scale)
    h, g, n, d = q.shape
    # one batched GEMM per KV head over its whole query group: K is read once, never expanded G times
    scores = torch.bmm(q.reshape(h, g * n, d), k.transpose(1, 2)).view(h, g, n, -1)  # [H, G, N, M]
    scores *= scale
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    scores -= lse.unsqueeze(-1)
    probs = scores.exp_()
    return torch.bmm(probs.view(h, g * n, -1), v).view(h, g, n, d), lse


def _attend_flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend` by the CPU flash kernel: each KV head a batch of one head, its G x N queries rows, so K
    and V are read once per KV head and never expanded; the mask additive, in q's dtype (the kernel's
    rule), repeated for each query head of the group."""
    h, g, n, d = q.shape
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf")).repeat(g, 1)  # [G*N, M]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.reshape(h, 1, g * n, d), k[:, None], v[:, None], 0.0, False, attn_mask=bias, scale=scale)[:2]
    return out.reshape(h, g, n, d), lse.reshape(h, g, n)


def merge(out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys -> the attention over both (by log-sum-exp). Updates
    `out` and `out2` in place (each a fresh attention output) where they have the log-sum-exp's dtype."""
    total = torch.logaddexp(lse, lse2)
    if out.dtype != total.dtype:  # fp16/bf16 outputs: accumulated at the log-sum-exp's fp32
        out, out2 = out.to(total.dtype), out2.to(total.dtype)
    out.mul_(torch.exp_(lse - total).unsqueeze(-1))
    return out.add_(out2.mul_(torch.exp_(lse2 - total).unsqueeze(-1))), total


class FetchArea:
    """The device memory host blocks are attended from: two halves, each `[2 (K, V), H, tokens, D]`
    with room for `half_blocks` host blocks (`half_tokens`: as many tokens of pages) and, after them, the
    sequence's device window, so one attention call covers the whole context when its host blocks fit a half.
    Exact pieces are fetched one ahead by a thread: piece i + 1 lands in one half while piece i is attended to
    from the other.

    CPU: the thread copies (numpy memcpys). CUDA: the thread issues piece i + 1's copies on a side
    stream the area owns (`non_blocking` from the pinned host slots), after an event recorded on the
    compute stream as piece i is taken (every read of piece i - 1, the last reader of that half, is queued
    before it); `take()` makes the compute stream wait for piece i's own event. The host never waits for
    the device on the exact path: slots are host metadata (CPU tensors) and nothing is read back. `end()`
    waits for the step's copies (their source is host memory the engine may reuse once the step is over)
    and adds up their times from their CUDA events."""

    def __init__(self, half_blocks: int, num_kv_heads: int, block_tokens: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, window_tokens: int = 0) -> None:
        if half_blocks <= 0:
            raise ValueError("the fetch area must hold at least one layer-block per half")
        self.half_blocks = half_blocks
        self.block_tokens = block_tokens
        self.window_tokens = window_tokens
        tokens = half_blocks * block_tokens + window_tokens
        self.buffer = torch.zeros((2, 2, num_kv_heads, tokens, head_dim), dtype=dtype, device=device)
        self.device = device
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None  # the copies' stream (CUDA)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-fetch")
        self._plan: list[tuple[int, torch.Tensor]] = []   # exact pieces, in the order they are attended to
        self._next = 0                                     # index of the next piece to take
        self._pending: Future | None = None                # -> (tokens, the copies' CUDA event or None)
        self._host: torch.Tensor | None = None             # [num_slots, L, 2, H, T, D] view of the DRAM slots
        self._host_bytes = None                            # its numpy byte view (CPU)
        self._buffer_bytes = byte_array(self.buffer) if device.type == "cpu" else None
        # CUDA: (start, done) events of this step's copies, read once the step ends (no sync per piece)
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()  # the fetch thread and a sparse gather on the step thread both count
        # the copies themselves, for copy bandwidth vs a memcpy: bytes, and seconds on the CPU's fetch
        # thread or, on CUDA, on the stream between each piece's events (overlapped or not)
        self.copied_bytes = 0
        self._copy_seconds = 0.0

    @property
    def host(self) -> torch.Tensor | None:
        return self._host

    @host.setter
    def host(self, payloads: torch.Tensor) -> None:
        """`[num_slots, L, 2, H, T, D]` view of the host memory's slots (`TierManager.host_payloads`)."""
        if self._side is not None and not payloads.is_pinned():
            # a non_blocking copy from pageable memory is staged by the driver: correct, never overlapped
            raise ValueError("offload on CUDA needs the DRAM tier's slots in pinned memory (HostTier pins its "
                             "arena when CUDA is available)")
        self._host = payloads
        self._host_bytes = byte_array(payloads) if payloads.device.type == "cpu" else None

    @property
    def half_tokens(self) -> int:
        """Host tokens a half holds before the window."""
        return self.half_blocks * self.block_tokens

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @property
    def copy_seconds(self) -> float:
        """Seconds the copies took (on CUDA: those of the steps that have ended)."""
        return self._copy_seconds

    # -- exact: a plan of pieces, fetched one ahead ---------------------------------------------
    def begin(self, plan: list[tuple[int, torch.Tensor]]) -> None:
        """`plan`: (layer, host slots) per piece (at most `half_blocks` slots), in attention order."""
        self._plan, self._next, self._pending = plan, 0, None
        if plan:
            self._pending = self._submit(0)

    def take(self) -> tuple[int, int, float]:
        """The next planned piece: (its half, its tokens there, the seconds waited for it: on CUDA the
        host's wait for the copies to be issued, not the device's for them to land)."""
        i = self._next
        assert self._pending is not None, f"take() past the plan of {len(self._plan)} pieces"
        start = time.perf_counter()
        num_tokens, done = self._pending.result()
        waited = time.perf_counter() - start
        self._next += 1
        self._pending = self._submit(self._next) if self._next < len(self._plan) else None
        if done is not None:  # the compute stream (not the host) waits for piece i's copies
            torch.cuda.current_stream(self.device).wait_event(done)
        return i % 2, num_tokens, waited

    def _submit(self, i: int) -> Future:
        # Piece i lands in the half piece i - 2 was attended from. Pieces are taken in order, so every
        # read of piece i - 2 (and any sparse gather into that half) was queued before piece i - 1 was
        # taken, i.e. before now: on CUDA the copies wait for this event on the compute stream (on the
        # CPU those reads have simply run).
        free = None
        if self._side is not None:
            free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(self.device))
        return self._pool.submit(self._fetch, i, free)

    def _fetch(self, i: int, free: torch.cuda.Event | None) -> tuple[int, torch.cuda.Event | None]:
        layer, slots = self._plan[i]
        # [n, 1]: every head the same block, so no per-head bookkeeping (Python holding the GIL the step waits for)
        return self._copy(layer, slots[:, None], i % 2, stream=self._side, after=free)

    def spare_half(self) -> int:
        """The half no exact piece is being fetched into now (sparse fetches go there)."""
        return (self._next + 1) % 2 if self._pending is not None else self._next % 2

    def gather(self, layer: int, slots: torch.Tensor, half: int, pages: torch.Tensor | None = None,
               page_tokens: int | None = None) -> int:
        """Layer `layer` of host blocks, or of pages of them, into one half: slots [n, H] (a CPU tensor), item
        j of head h is from block `slots[j, h]` (sparse: each head its own), or [n, 1]: every head from
        block `slots[j, 0]` (exact); `pages` [n, H] (CPU): which page of `page_tokens` (P) tokens of that block
        (None: the whole block, P = T). Lands at tokens [0, n P) of the half, each head's K and V contiguous.
        Returns n P. On CUDA the copies are queued on the current stream (attention after it on that stream
        sees them)."""
        return self._copy(layer, slots, half, pages, page_tokens)[0]

    def _copy(self, layer: int, slots: torch.Tensor, half: int, pages: torch.Tensor | None = None,
              page_tokens: int | None = None, stream: torch.cuda.Stream | None = None,
              after: torch.cuda.Event | None = None) -> tuple[int, torch.cuda.Event | None]:
        n, h = slots.shape
        t = page_tokens or self.block_tokens
        assert self.block_tokens % t == 0 and n * t <= self.half_tokens, (n, t, self.half_tokens)
        assert slots.device.type == "cpu" and (pages is None or pages.device.type == "cpu"), \
            "host slots are host metadata: reading them from a device would sync"
        firsts = (pages * t).tolist() if pages is not None else [[0] * h] * n  # each item's first token in its block
        items = [list(zip(row, first)) for row, first in zip(slots.tolist(), firsts)]  # [n][H] (slot, first token)
        uniform = all(len(set(row)) == 1 for row in items)  # every head the same block (page): one copy per item
        if self._side is None:
            start = time.perf_counter()
            self._memcpy(layer, items, t, half, uniform)
            self._count(self._bytes(n * t), time.perf_counter() - start)
            return n * t, None
        done = self._cuda_copy(layer, items, t, half, uniform, stream, after)
        self._count(self._bytes(n * t), 0.0)  # its time: from its events, at end()
        return n * t, done

    def _memcpy(self, layer: int, items: list[list[tuple[int, int]]], t: int, half: int, uniform: bool) -> None:
        # single-threaded memcpys (numpy): torch's copies fan out to every core and crawl
        # beside a forward that already uses them (the same reason as RawArena.write_block)
        dst, src = self._buffer_bytes[half], self._host_bytes[:, layer]  # [2, H, tokens, D B], [S, 2, H, T, D B]
        for j, row in enumerate(items):
            if uniform:
                slot, first = row[0]
                dst[:, :, j * t:(j + 1) * t] = src[slot, :, :, first:first + t]
                continue
            for head, (slot, first) in enumerate(row):
                dst[:, head, j * t:(j + 1) * t] = src[slot, :, head, first:first + t]

    def _cuda_copy(self, layer: int, items: list[list[tuple[int, int]]], t: int, half: int, uniform: bool,
                   stream: torch.cuda.Stream | None, after: torch.cuda.Event | None) -> torch.cuda.Event:
        """Queue the copies on `stream` (default: the current one), after `after`; returns their event."""
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        host, dst = self._host[:, layer], self.buffer[half]  # [S, 2, H, T, D] pinned, [2, H, tokens, D]
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            start.record(stream)
            for j, row in enumerate(items):
                if uniform:
                    # [2, H, t, D] (a whole block: contiguous in the slot) into a strided range of the half:
                    # torch makes it one cudaMemcpyAsync into a temporary on this stream (a layer-block, from
                    # the allocator's cache, outside the budget) and one device copy kernel (Copy.cu)
                    slot, first = row[0]
                    dst[:, :, j * t:(j + 1) * t].copy_(host[slot, :, :, first:first + t], non_blocking=True)
                    continue
                for head, (slot, first) in enumerate(row):
                    for kv in range(2):  # a head's K (V) of a page: t x D contiguous on both sides, one cudaMemcpyAsync
                        dst[kv, head, j * t:(j + 1) * t].copy_(host[slot, kv, head, first:first + t], non_blocking=True)
            done.record(stream)
        self._timings.append((start, done))
        return done

    def _bytes(self, num_tokens: int) -> int:
        """Bytes of K and V of every head for `num_tokens` tokens of a layer: what a copy into a half moves."""
        return 2 * self.buffer.shape[2] * num_tokens * self.buffer.shape[-1] * self.buffer.element_size()

    def _count(self, num_bytes: int, seconds: float) -> None:
        with self._lock:
            self.copied_bytes += num_bytes
            self._copy_seconds += seconds

    def kv(self, half: int, num_tokens: int) -> torch.Tensor:
        """[2, H, num_tokens, D]: the first tokens of a half."""
        return self.buffer[half, :, :, :num_tokens]

    def append_window(self, half: int, num_tokens: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Put the device window k, v [H, m, D] after the `num_tokens` host tokens of a half: the
        sequence's whole context [2, H, num_tokens + m, D], ready for one attention call."""
        m = k.shape[1]
        assert m <= self.window_tokens + (self.half_tokens - num_tokens), (m, num_tokens)
        self.buffer[half, 0, :, num_tokens:num_tokens + m] = k
        self.buffer[half, 1, :, num_tokens:num_tokens + m] = v
        return self.buffer[half, :, :, :num_tokens + m]

    def end(self) -> None:
        """After the step's forward (also a failed one): the fetch thread idle, and on CUDA every copy
        queued this step landed, its time added up."""
        pending, self._plan, self._pending = self._pending, [], None
        try:
            if pending is not None:
                pending.result()
        finally:
            self._settle()

    def _settle(self) -> None:
        # Waits on the step's own events only (no device-wide sync). A copy reads a host slot when the
        # device runs it: once the step is over the engine may unpin the slot and a put may rewrite it.
        seconds = 0.0
        for start, done in self._timings:
            done.synchronize()
            seconds += start.elapsed_time(done) / 1e3  # milliseconds
        self._timings.clear()
        self._count(0, seconds)

    def close(self) -> None:
        self.end()
        self._pool.shutdown(wait=True)


class OffloadAttention:
    """Attention of an offloaded sequence: its device window (sinks + recent, from the arena) and
    its host blocks (through the fetch area; sparse: each head's pages of `page_tokens`). When what it
    reads fits one half of the fetch area (the usual case), the window is appended after it and one SDPA
    call (the kernel the rest of the engine uses) covers the whole context; otherwise the pieces are
    merged by their log-sum-exp."""

    def __init__(self, fetch: FetchArea, num_layers: int, page_tokens: int | None = None) -> None:
        self.fetch = fetch
        self.num_layers = num_layers
        self.page_tokens = page_tokens or fetch.block_tokens  # None: a page is the block
        self.pages_per_block = fetch.block_tokens // self.page_tokens
        assert self.pages_per_block * self.page_tokens == fetch.block_tokens, (self.page_tokens, fetch.block_tokens)

    def plan(self, offloads: list[SeqOffload | None]) -> None:
        """Before the forward: every exact piece of the step in attention order (layer, then sequence)."""
        plan = []
        half = self.fetch.half_blocks
        for layer in range(self.num_layers):
            for off in offloads:
                if off is None or not off.slots.numel() or self._sparse(off):
                    continue
                plan += [(layer, off.slots[i:i + half]) for i in range(0, off.slots.numel(), half)]
        self.fetch.begin(plan)

    def _sparse(self, off: SeqOffload) -> bool:
        num_pages = off.slots.numel() * self.pages_per_block
        return off.mode.kind == "sparse" and off.decode and off.mode.num_fetched(num_pages) < num_pages

    def forward(self, layer: int, q: torch.Tensor, k_dev: torch.Tensor, v_dev: torch.Tensor, off: SeqOffload,
                scale: float) -> torch.Tensor:
        """q [Hq, N, D]; k_dev, v_dev [H, M, D] (the device window) -> out [Hq, N, D]."""
        h = k_dev.shape[0]
        hq, n, d = q.shape
        dev_mask = off.key_positions[None, :] <= off.q_positions[:, None]  # [N, M]
        num_host = off.slots.numel()
        if self._sparse(off):  # each head's top pages: slots [k, H], pages [k, H]
            slots, pages, t = *self._sparse_pages(layer, q.view(h, hq // h, n, d), off), self.page_tokens
        else:
            slots, pages, t = off.slots[:, None].expand(-1, h), None, self.fetch.block_tokens
        if slots.shape[0] * t <= self.fetch.half_tokens:  # one call over [host tokens, window]
            if num_host == 0:
                return F.scaled_dot_product_attention(q[None], k_dev[None], v_dev[None], attn_mask=dev_mask,
                                                      scale=scale, enable_gqa=hq != h)[0]
            half, num_tokens = self._fetch_one(layer, slots, pages, t, off)
            kv = self.fetch.append_window(half, num_tokens, k_dev, v_dev)
            mask = None
            if n > 1:  # every host token precedes every query; the window is causal by position
                mask = torch.cat([torch.ones((n, num_tokens), dtype=torch.bool, device=q.device), dev_mask], dim=1)
            return F.scaled_dot_product_attention(q[None], kv[0][None], kv[1][None], attn_mask=mask, scale=scale,
                                                  enable_gqa=hq != h)[0]
        q4 = q.reshape(h, hq // h, n, d).contiguous()  # once: every piece reads its KV heads' query rows
        out, lse = attend(q4, k_dev, v_dev, dev_mask, scale)
        for k_host, v_host in self._pieces(layer, slots, pages, t, off):
            out, lse = merge(out, lse, *attend(q4, k_host, v_host, None, scale))
        return out.view(hq, n, d)

    def _fetch_one(self, layer: int, slots: torch.Tensor, pages: torch.Tensor | None, t: int,
                   off: SeqOffload) -> tuple[int, int]:
        """The sequence's host blocks (sparse: pages of t tokens) of this layer in one half: (half, tokens)."""
        if self._sparse(off):
            start = time.perf_counter()
            half = self.fetch.spare_half()
            num_tokens = self.fetch.gather(layer, slots, half, pages, t)
            self._count(off, num_tokens, time.perf_counter() - start)
            return half, num_tokens
        half, num_tokens, waited = self.fetch.take()
        self._count(off, num_tokens, waited)
        return half, num_tokens

    def _pieces(self, layer: int, slots: torch.Tensor, pages: torch.Tensor | None, t: int, off: SeqOffload):
        """More than a half holds: one half-full piece at a time, as K, V [H, tokens, D]."""
        per_piece = self.fetch.half_tokens // t  # exact: half_blocks blocks, as planned
        for i in range(0, slots.shape[0], per_piece):
            if self._sparse(off):
                start = time.perf_counter()
                half = self.fetch.spare_half()
                num_tokens = self.fetch.gather(layer, slots[i:i + per_piece], half, pages[i:i + per_piece], t)
                waited = time.perf_counter() - start
            else:
                half, num_tokens, waited = self.fetch.take()
            self._count(off, num_tokens, waited)
            kv = self.fetch.kv(half, num_tokens)
            yield kv[0], kv[1]

    def _sparse_pages(self, layer: int, q4: torch.Tensor, off: SeqOffload) -> tuple[torch.Tensor, torch.Tensor]:
        """The pick for each KV head (`select_pages`), in context order: the host slots [k, H] of its top pages and each
        one's page in its block [k, H]."""
        k = off.mode.num_fetched(off.slots.numel() * self.pages_per_block)
        # the host issues the copies, so it must know the pick: on CUDA this read-back waits for the layer
        top = select_pages(off.summaries[:, layer], q4[:, :, -1], k).cpu()  # [k, H]: block * pages + page
        return off.slots[top // self.pages_per_block], top % self.pages_per_block

    def _count(self, off: SeqOffload, num_tokens: int, seconds: float) -> None:
        buffer = self.fetch.buffer
        num_bytes = 2 * buffer.shape[2] * num_tokens * buffer.shape[-1] * buffer.element_size()
        off.stats.fetched_bytes += num_bytes
        off.stats.fetch_seconds += seconds
        if off.decode:
            off.stats.decode_fetched_bytes += num_bytes
