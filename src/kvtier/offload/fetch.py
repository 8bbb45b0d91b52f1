"""The fetch area: device memory host blocks are attended from (see `kvtier.offload`)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvtier.codecs.codec import byte_array
from kvtier.offload.pages import gather_pages


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
        """`[num_slots, L, 2, H, T, D]` view of the host memory's slots (`HostBlockPool.payloads`)."""
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
        Returns n P. On the CPU: `pages.gather_pages` (the gather `HostKV` makes too). On CUDA the copies are
        queued on the current stream, one per head's page from the pinned slots (attention after it on that
        stream sees them)."""
        return self._copy(layer, slots, half, pages, page_tokens)[0]

    def _copy(self, layer: int, slots: torch.Tensor, half: int, pages: torch.Tensor | None = None,
              page_tokens: int | None = None, stream: torch.cuda.Stream | None = None,
              after: torch.cuda.Event | None = None) -> tuple[int, torch.cuda.Event | None]:
        n, h = slots.shape
        t = page_tokens or self.block_tokens
        assert self.block_tokens % t == 0 and n * t <= self.half_tokens, (n, t, self.half_tokens)
        assert slots.device.type == "cpu" and (pages is None or pages.device.type == "cpu"), \
            "host slots are host metadata: reading them from a device would sync"
        if self._side is None:
            start = time.perf_counter()
            if h == 1 and pages is None and t == self.block_tokens:  # whole blocks (an exact piece: the fetch thread)
                self._memcpy(layer, slots[:, 0].tolist(), half)
            else:  # each head its own pages (a sparse pick): the one gather of picked pages (`HostKV`'s too)
                pages = torch.zeros_like(slots) if pages is None else pages
                for kv in range(2):
                    gather_pages(self._host[:, layer, kv], slots, pages, t, self.buffer[half, kv, :, :n * t])
            self._count(self._bytes(n * t), time.perf_counter() - start)
            return n * t, None
        firsts = (pages * t).tolist() if pages is not None else [[0] * h] * n  # each item's first token in its block
        items = [list(zip(row, first)) for row, first in zip(slots.tolist(), firsts)]  # [n][H] (slot, first token)
        uniform = all(len(set(row)) == 1 for row in items)  # every head the same block (page): one copy per item
        done = self._cuda_copy(layer, items, t, half, uniform, stream, after)
        self._count(self._bytes(n * t), 0.0)  # its time: from its events, at end()
        return n * t, done

    def _memcpy(self, layer: int, slots: list[int], half: int) -> None:
        # whole blocks, single-threaded memcpys (numpy): torch's copies fan out to every core and crawl
        # beside a forward that already uses them (the fetch thread's; the same reason as RawArena.write_block)
        dst, src = self._buffer_bytes[half], self._host_bytes[:, layer]  # [2, H, tokens, D B], [S, 2, H, T, D B]
        t = self.block_tokens
        for j, slot in enumerate(slots):
            dst[:, :, j * t:(j + 1) * t] = src[slot]

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
