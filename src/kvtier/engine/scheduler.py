"""Continuous batching: who runs this step, how many of their tokens, and what moves where.

Each step, in this order: running sequences that decode get one token each (a sequence that needs
a new block and finds none preempts the youngest running sequence, see `_preempt`); running
sequences still in prefill get a chunk of the prefill token budget; then waiting requests are
admitted, FIFO (a preempted sequence first). Admission reuses the longest prefix found on the
device, then asks the tiers which of the next blocks they hold (`match_tiers`: one batched lookup
per tier, no data moved). With tier hits the sequence gets device blocks for them and waits in
WAITING_FOR_KV while the engine's transfer worker loads them (a `LoadJob` in the output);
`finish_load` registers what arrived and makes it RUNNING, so only the uncached rest is computed.
The scheduler never waits on a tier read.

The scheduler only decides; the engine carries out the `SchedulerOutput` (copies, tier transfers,
the forward) and hands the sampled tokens back to `postprocess`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.blocks import KeyChain, KeySpace
from kvtier.engine.block_manager import BlockManager, BlockOrigin
from kvtier.engine.sequence import Sequence, SeqStatus
from kvtier.engine.tier_io import LoadJob
from kvtier.offload.config import OffloadConfig
from kvtier.tiers.manager import PrefixMatch

# keys -> which tier holds each block of the longest prefix held in the tiers (TierManager.match)
MatchTiers = Callable[[list[bytes]], PrefixMatch]

DEVICE = "device"  # the tier name reported for prefix hits in the device arena


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int        # position of the first token computed this step
    num_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """What the engine must do this step. Reads (evicted blocks copied out) come before writes (the forward)."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    evicted: list[tuple[bytes, int]] = field(default_factory=list)        # cached blocks to write to the tiers
    loads: list[LoadJob] = field(default_factory=list)                    # tier blocks -> device blocks (async)
    preempted: list[str] = field(default_factory=list)                    # request ids sent back to waiting
    failed: list[Sequence] = field(default_factory=list)                  # refused at admission (finished: error)
    offloads: list[Offload] = field(default_factory=list)                 # device -> host memory, before the forward


@dataclass(slots=True)
class Offload:
    """A full block of an offloaded sequence leaves its device window for host memory: copy it out
    of `block_id` (already released: reused after this step's copies) and pin it under `key`."""

    seq: Sequence
    index: int        # its place in the sequence (host block index + sink blocks)
    key: bytes
    block_id: int


class Scheduler:
    def __init__(self, block_manager: BlockManager, space: KeySpace, *, max_num_seqs: int = 32,
                 max_prefill_tokens: int = 512, max_model_tokens: int = 2048, eos_token_ids: tuple[int, ...] = (),
                 prefix_caching: bool = True, match_tiers: MatchTiers | None = None,
                 offload: OffloadConfig | None = None) -> None:
        self.block_manager = block_manager
        self.space = space
        self.block_tokens = space.layout.block_tokens
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.max_model_tokens = max_model_tokens
        self.eos_token_ids = set(eos_token_ids)
        self.prefix_caching = prefix_caching
        self.match_tiers = match_tiers if prefix_caching else None
        self.waiting: deque[Sequence] = deque()
        self.loading: dict[str, Sequence] = {}   # WAITING_FOR_KV: blocks allocated, a load in flight
        # blocks of loads whose request ended meanwhile: the transfer worker may still be writing
        # them, so they go back to the free list only when the load returns (finish_load)
        self._orphaned_loads: dict[str, list[int]] = {}
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens_by_tier: dict[str, int] = {}
        self._newly_full: list[tuple[bytes, int]] = []  # (key, block id) computed since `take_newly_full`
        self._spaces: dict[str, KeySpace] = {}
        # offloaded sequences keep blocks [0, sink) and the last `recent` on the device (kvtier/offload/)
        self.offload = offload if offload is not None else OffloadConfig(None, self.block_tokens)
        self.sink_blocks, self.recent_blocks = self.offload.sink_blocks, self.offload.recent_blocks
        self._unpinned: list[bytes] = []  # host blocks of offloaded sequences that ended or were preempted

    # -- requests --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        return self._remove(request_id, "abort")

    def fail(self, request_id: str, error: str) -> Sequence | None:
        """Finish a request with finish_reason "error" wherever it is (its step failed)."""
        seq = self._remove(request_id, "error")
        if seq is not None:
            seq.error = error
        return seq

    def _remove(self, request_id: str, reason: str) -> Sequence | None:
        if request_id in self.loading:  # its load result, when it comes, is dropped (finish_load: None)
            seq = self.loading.pop(request_id)
            first = seq.num_keyed_blocks  # the load blocks follow the device-cached ones
            self._orphaned_loads[request_id] = seq.block_ids[first:first + seq.num_loading_blocks]
            del seq.block_ids[first:first + seq.num_loading_blocks]
            self._finish(seq, reason)
            return seq
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._finish(seq, reason)
                    return seq
        return None

    def has_unfinished(self) -> bool:
        """Work left: requests, or loads of requests that ended meanwhile (their blocks, device and
        host, come back only when the load returns: the engine keeps stepping until then)."""
        return bool(self.waiting or self.running or self.loads_in_flight())

    def loads_in_flight(self) -> bool:
        return bool(self.loading or self._orphaned_loads)

    def has_load_in_flight(self, request_id: str) -> bool:
        """Whether a load for this request id (running or ended) has not come back yet."""
        return request_id in self.loading or request_id in self._orphaned_loads

    @property
    def num_active(self) -> int:
        """Sequences holding device blocks for their whole prompt: running, or loading their prefix."""
        return len(self.running) + len(self.loading)

    # -- schedule --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled = self._schedule_running(out)
        budget = self.max_prefill_tokens
        for seq in [s for s in self.running if s not in scheduled]:  # prefill chunks
            if budget <= 0:
                break
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.host is not None:
                num_tokens = self._window_chunk(seq, num_tokens, out)
                if not num_tokens:
                    continue  # no device block free for its window now: a later step
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_tokens))
            budget -= num_tokens
        if not out.preempted:  # a sequence just preempted is not readmitted into the blocks it freed
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput) -> set[Sequence]:
        """One token for every decoding sequence, preempting the youngest when blocks run out."""
        scheduled: set[Sequence] = set()
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            if seq.num_tokens - seq.num_computed_tokens != 1:
                continue  # still in prefill: blocks were allocated at admission
            while not (self._window_chunk(seq, 1, out) if seq.host is not None
                       else self._reserve_blocks(seq, seq.num_tokens, out)):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, 1))
                scheduled.add(seq)
        return scheduled

    def _reserve_blocks(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Grow `seq`'s table to hold `num_tokens`; False (nothing allocated) when it cannot."""
        num_new = -(-num_tokens // self.block_tokens) - len(seq.block_ids)
        if not self.block_manager.can_allocate(num_new):
            return False
        for _ in range(num_new):
            seq.block_ids.append(self._allocate(out))
        return True

    def _window_chunk(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> int:
        """An offloaded sequence computes tokens [start, start + n): its device window becomes the sink
        blocks and the last `recent_blocks` through the chunk's end; the full blocks in between leave
        for host memory (`out.offloads`). n is capped so the chunk's blocks fit the recent window.
        Returns n, or 0 (nothing changed) when its new blocks cannot be allocated."""
        t, start = self.block_tokens, seq.num_computed_tokens
        end = min(start + num_tokens, (start // t + self.recent_blocks) * t)
        last = -(-end // t)
        first_recent = max(self.sink_blocks, last - self.recent_blocks)
        leaving = [i for i in range(self.sink_blocks, min(first_recent, len(seq.block_ids))) if seq.block_ids[i] >= 0]
        num_new = last - len(seq.block_ids)
        bm = self.block_manager
        num_freed = sum(1 for i in leaving if bm.ref_counts[seq.block_ids[i]] == 1)  # shared ones stay used
        if not bm.can_allocate(num_new - num_freed):
            return 0
        for i in leaving:  # full and computed (i < start // t), so keyed; in order, after those already out
            assert i == self.sink_blocks + len(seq.host) + sum(1 for o in out.offloads if o.seq is seq), i
            out.offloads.append(Offload(seq, i, seq.key_chain.keys[i], seq.block_ids[i]))
            self.block_manager.release([seq.block_ids[i]])
            seq.block_ids[i] = -1
        for _ in range(num_new):
            seq.block_ids.append(self._allocate(out))
        return end - start

    def _allocate(self, out: SchedulerOutput) -> int:
        block_id, evicted = self.block_manager.allocate()
        if evicted is not None:
            out.evicted.append(evicted)
        return block_id

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Send `seq` back to the front of the queue, its blocks released, its generated tokens now part
        of its prompt. Its full blocks keep their keys in the device cache (cached-free) until evicted,
        and are in the tiers by then (written when full, or copied out on eviction), so readmission finds
        them on the device or loads them; the partial last block is recomputed (and, without tiers, what
        the device evicted meanwhile)."""
        self.running.remove(seq)
        self.num_preemptions += 1
        out.preempted.append(seq.request_id)
        seq.num_computed_tokens = seq.num_keyed_blocks = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self._release_blocks(seq)
        out.offloads = [o for o in out.offloads if o.seq is not seq]  # its KV is dropped, not moved

    # -- admission -------------------------------------------------------------------------------
    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and self.num_active < self.max_num_seqs:
            seq = self.waiting[0]
            try:
                admitted = self._admit(seq, out)
            except Exception as exc:  # noqa: BLE001 — this request alone (e.g. its keys cannot be made)
                out.failed.append(self.fail(seq.request_id, f"admission failed: {exc}"))
                continue
            if not admitted:
                return
            self.waiting.popleft()
            if seq.status is SeqStatus.WAITING_FOR_KV:
                continue  # computes nothing until its tier blocks are in
            num_tokens = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if seq.host is not None and not (num_tokens := self._window_chunk(seq, num_tokens, out)):
                continue
            out.chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_tokens))
            budget -= num_tokens

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks; False if they do not fit.
        With blocks to load from the tiers it is parked in `loading` (WAITING_FOR_KV), else RUNNING.
        Nothing changes before the last call that can raise (`match_tiers`)."""
        if seq.host is not None:
            return self._admit_offloaded(seq, out)
        bm, block_tokens = self.block_manager, self.block_tokens
        keys = self._keys(seq, len(seq.token_ids) // block_tokens)
        usable = (seq.num_tokens - 1) // block_tokens  # the last token is always computed (its logits)
        if seq.needs_prompt_logits:
            usable = 0  # prompt logprobs need the logits of every prompt position: no cache hit
        device_ids = bm.match_prefix(keys[:usable]) if self.prefix_caching else []
        num_needed = -(-seq.num_tokens // block_tokens) - len(device_ids)
        num_revived = sum(1 for b in device_ids if bm.ref_counts[b] == 0)
        # keep a block per active sequence in reserve for their next decode
        if bm.num_free_blocks - num_revived < num_needed + self._num_reserved_blocks():
            return False
        match = None
        if self.match_tiers is not None and usable > len(device_ids):
            match = self.match_tiers(keys[len(device_ids):usable]) or None
        for block_id in device_ids:
            bm.acquire(block_id)
        new_ids = [self._allocate(out) for _ in range(num_needed)]
        seq.block_ids = device_ids + new_ids
        seq.num_keyed_blocks = len(device_ids)
        seq.num_computed_tokens = len(device_ids) * block_tokens
        self._count_hits(seq, [DEVICE] * len(device_ids))
        if match is not None:
            out.loads.append(LoadJob(seq.request_id, match, new_ids[:len(match)]))
            seq.num_loading_blocks = len(match)
            seq.status = SeqStatus.WAITING_FOR_KV
            self.loading[seq.request_id] = seq
        else:
            self._start_running(seq)
        return True

    def _num_reserved_blocks(self) -> int:
        """Blocks kept free for the active sequences: one each for a next decode, and what an offloaded
        sequence's window still lacks (a full window moves on without a net new block)."""
        window = self.sink_blocks + self.recent_blocks
        return sum(1 if seq.host is None else max(0, window - seq.num_device_blocks)
                   for seq in [*self.running, *self.loading.values()])

    def _admit_offloaded(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """A sequence longer than the device: admitted once its whole window fits beside the other
        active sequences' reserve. Its cached prefix is reused (`_reuse_offloaded_prefix`); the rest of
        its prompt is computed chunk by chunk, its blocks allocated per chunk (`_window_chunk`)."""
        window = self.sink_blocks + self.recent_blocks
        if self.block_manager.num_free_blocks < window + self._num_reserved_blocks():
            return False
        seq.block_ids, seq.num_keyed_blocks, seq.num_computed_tokens = [], 0, 0
        usable = 0 if seq.needs_prompt_logits else (seq.num_tokens - 1) // self.block_tokens
        if self.prefix_caching and usable > self.sink_blocks:
            return self._reuse_offloaded_prefix(seq, self._keys(seq, usable), out)
        self._start_running(seq)
        return True

    def _reuse_offloaded_prefix(self, seq: Sequence, keys: list[bytes], out: SchedulerOutput) -> bool:
        """An offloaded sequence's cached prefix, laid out as its own computation would have left it:
        the sink blocks on the device (cached there, or loaded from the tiers), and the blocks after
        them as its host blocks, up to the first no tier holds (held in DRAM slots: pinned where the
        DRAM tier holds them, no copy; read from below into slots otherwise). One lookup finds both,
        split in two parts of one `LoadJob`; the transfer worker loads them while the sequence waits
        (WAITING_FOR_KV), the host part only once every sink block is in. Its recent window starts
        empty at the first block to compute."""
        bm, sink = self.block_manager, self.sink_blocks
        device_ids = bm.match_prefix(keys[:sink])
        keys = keys[:sink + seq.host.reserved_blocks]
        match = self.match_tiers(keys[len(device_ids):]) if self.match_tiers is not None else None
        host_match = None
        if match is not None and len(device_ids) + len(match) > sink:
            num_device = sink - len(device_ids)
            match, host_match = match.part(0, num_device), match.part(num_device)
        for block_id in device_ids:
            bm.acquire(block_id)
        new_ids = [self._allocate(out) for _ in range(len(match) if match is not None else 0)]
        seq.block_ids = device_ids + new_ids
        seq.num_keyed_blocks = len(device_ids)
        seq.num_computed_tokens = len(device_ids) * self.block_tokens
        self._count_hits(seq, [DEVICE] * len(device_ids))
        if not new_ids and host_match is None:
            self._start_running(seq)
            return True
        seq.num_loading_blocks = len(new_ids)
        out.loads.append(LoadJob(seq.request_id, match, new_ids, host_match=host_match))
        seq.status = SeqStatus.WAITING_FOR_KV
        self.loading[seq.request_id] = seq
        return True

    def _host_prefix_ready(self, seq: Sequence, tiers: list[str]) -> None:
        """Its sink blocks are on the device: the host blocks held after them count as computed."""
        seq.block_ids += [-1] * len(tiers)  # not on the device: in `seq.host`
        seq.num_keyed_blocks = len(self._keys(seq, seq.num_keyed_blocks + len(tiers)))
        seq.num_computed_tokens = seq.num_keyed_blocks * self.block_tokens
        self._count_hits(seq, tiers)

    def finish_load(self, request_id: str, num_loaded: int, tiers: list[str],
                    host_tiers: list[str]) -> Sequence | None:
        """The transfer worker filled the first `num_loaded` of the sequence's load blocks (the rest
        came back bad or missing: they are computed). Registers them and makes the sequence RUNNING;
        None if the request ended meanwhile (then the blocks the load was writing are freed now).
        An offloaded sequence's host blocks (already in `seq.host`, from `host_tiers`) count once its
        sink blocks are all in; else they are let go."""
        orphaned = self._orphaned_loads.pop(request_id, None)
        if orphaned is not None:
            self.block_manager.release(orphaned)
        seq = self.loading.pop(request_id, None)
        if seq is None:
            return None
        seq.num_loading_blocks = 0
        first = seq.num_keyed_blocks
        keys = self._keys(seq, first + num_loaded)
        for i in range(first, len(keys)):
            self.block_manager.register(seq.block_ids[i], keys[i], self._origin(seq, i, tiers[i - first]))
        seq.num_keyed_blocks = len(keys)
        seq.num_computed_tokens = len(keys) * self.block_tokens
        self._count_hits(seq, tiers[:num_loaded])
        if seq.host is not None and seq.host.keys:  # an offloaded prefix: its host blocks follow the sinks
            if len(keys) == self.sink_blocks:
                self._host_prefix_ready(seq, list(host_tiers))
            else:  # a sink block came back bad: the prefix ends there, the host blocks are not used
                self._unpinned += seq.host.keys
                seq.host.slots, seq.host.keys = [], []
        self._start_running(seq)
        return seq

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        if not seq.admitted:
            seq.admitted = True
            seq.num_cached_tokens = seq.num_computed_tokens

    def _count_hits(self, seq: Sequence, tiers: list[str]) -> None:
        if seq.admitted:  # hits are counted at a request's first admission only
            return
        for tier in tiers:
            seq.cached_tokens_by_tier[tier] = seq.cached_tokens_by_tier.get(tier, 0) + self.block_tokens
            self.prefix_hit_tokens_by_tier[tier] = self.prefix_hit_tokens_by_tier.get(tier, 0) + self.block_tokens

    def _keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of `seq`'s first `num_blocks` full blocks, from its chain (each block hashed once in
        its life: waiting, loading, registering and readmission after a preemption read the same list)."""
        if seq.key_chain is None:
            seq.key_chain = KeyChain(self._space(seq.namespace))
        return seq.key_chain.extend(seq.token_ids, num_blocks)

    def _space(self, namespace: str) -> KeySpace:
        if namespace not in self._spaces:
            self._spaces[namespace] = self.space.with_namespace(namespace)
        return self._spaces[namespace]

    # -- after the forward -----------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: dict[str, int],
                    errors: dict[str, str] | None = None) -> list[Sequence]:
        """Advance the scheduled sequences; returns those that got a token (finished ones included)
        and those that failed (`errors`: request id -> why; finished with "error", no token)."""
        updated = []
        for chunk in out.chunks:
            seq = chunk.seq
            if errors and seq.request_id in errors:
                updated.append(self.fail(seq.request_id, errors[seq.request_id]))
                continue
            seq.num_computed_tokens += chunk.num_tokens
            self._register_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            token = sampled[seq.request_id]
            seq.token_ids.append(token)
            updated.append(seq)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
        return updated

    def take_newly_full(self) -> list[tuple[bytes, int]]:
        """(key, block id) of the blocks computed and registered since the last call."""
        taken, self._newly_full = self._newly_full, []
        return taken

    def _register_full_blocks(self, seq: Sequence) -> None:
        block_tokens = self.block_tokens
        while seq.num_keyed_blocks < seq.num_computed_tokens // block_tokens:
            i = seq.num_keyed_blocks
            key = self._keys(seq, i + 1)[i]
            seq.num_keyed_blocks += 1
            if self.prefix_caching and self.block_manager.register(seq.block_ids[i], key, self._origin(seq, i)):
                self._newly_full.append((key, seq.block_ids[i]))

    def _origin(self, seq: Sequence, index: int, tier: str | None = None) -> BlockOrigin | None:
        """What block `index`'s key was hashed from, and the tier it was loaded from, for the block manager's
        watcher (None, nothing built, when no one watches)."""
        if self.block_manager.events is None:
            return None
        start, keys = index * self.block_tokens, seq.key_chain.keys
        return BlockOrigin(keys[index - 1] if index else None, tuple(seq.token_ids[start:start + self.block_tokens]),
                           seq.namespace, tier)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        # EOS and stop_token_ids are masked for the first min_tokens tokens (ModelRunner._bias)
        stops = token in seq.sampling.stop_token_ids or (not seq.sampling.ignore_eos and token in self.eos_token_ids)
        if seq.num_generated_tokens > seq.sampling.min_tokens and stops:
            return "stop"
        if seq.num_generated_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self.max_model_tokens:
            return "length"
        return None

    def _release_blocks(self, seq: Sequence) -> None:
        """Free its device blocks; its host blocks (offloaded) go to `take_unpinned` (the engine unpins)."""
        self.block_manager.release([b for b in seq.block_ids if b >= 0])
        seq.block_ids = []
        if seq.host is not None and seq.host.slots:
            self._unpinned += seq.host.keys
            seq.host.slots, seq.host.keys = [], []

    def take_unpinned(self) -> list[bytes]:
        """Keys of host blocks no sequence needs any more (finished, aborted, preempted)."""
        taken, self._unpinned = self._unpinned, []
        return taken

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._release_blocks(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
