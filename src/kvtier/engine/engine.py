"""`LLMEngine`: the synchronous core — schedule, move blocks, run, postprocess — nano-vllm style.

The engine is the only caller of the tier manager while serving. The step thread only asks the
tiers which blocks they hold (`TierManager.match`, at admission); every read, verify, decode, encode
and write runs on the transfer worker (`engine/tier_io.py`). Each block goes down once, as soon as
it is full and computed (`tier_writes="full"`, so another server sharing a pool sees a prefix while
this one still holds it), or when the device evicts it (`"evict"`); prefix blocks come back up while
their sequence waits in WAITING_FOR_KV, and `step()` polls the finished loads into the arena.
A preempted sequence takes the same way back: its full blocks are in the device cache or the
tiers, its partial last block is recomputed (no host memory besides the DRAM tier's).

One request never breaks the others: a sequence that cannot be sampled, admitted or moved finishes
with finish_reason "error" (`RequestOutput.error` says why) and the step goes on without it; a
failed forward fails the sequences of that step only (waiting ones are untouched).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from kvtier.blocks import KeySpace, key_codec
from kvtier.codecs import get_codec
from kvtier.config import PAGE_SUMMARY_VECTORS, EngineConfig
from kvtier.engine.arena import make_arena
from kvtier.engine.block_manager import BlockManager
from kvtier.engine.limits import check_engine, fetch_half_blocks
from kvtier.engine.model_runner import ModelRunner, RunOutput
from kvtier.offload.attention import HostBlocks, OffloadAttention
from kvtier.offload.config import OffloadMode, parse_offload
from kvtier.offload.fetch import FetchArea
from kvtier.offload.pages import page_summary
from kvtier.offload.pool import HostBlockPool, HostRoomError, PinnedInHost  # noqa: F401 — HostRoomError: the server's
from kvtier.offload.stats import OffloadStats
from kvtier.engine.scheduler import Offload, Scheduler, SchedulerOutput
from kvtier.engine.sequence import SamplingParams, Sequence, TokenLogprob
from kvtier.engine.tier_io import LoadDone, TierIO
from kvtier.transfer.copies import copy_threads

log = logging.getLogger(__name__)


class OffloadUnavailableError(ValueError):
    """A request asked for kv_offload from an engine started without it (the message is for the client)."""


class ContextLengthError(ValueError):
    """A request longer than the engine can ever hold (the message is for the client). `param` is
    the request field to change: "prompt" or "max_tokens"."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    error: str | None = None   # finish_reason "error": why this request failed (the others went on)
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids (SamplingParams.logprobs set)
    # of every prompt token (the first: None), in the output of its first token (prompt_logprobs set)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    offload: OffloadStats | None = None  # an offloaded request (longer than the device): what it cost


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_device_blocks_used: int     # used by sequences (cached-free blocks not counted)
    num_device_blocks_cached: int   # free but holding a cached prefix block
    num_device_blocks_total: int
    num_preemptions: int
    num_blocks_written_to_tiers: int
    prefix_hit_tokens_by_tier: dict[str, int]
    kv_codec: str = "raw"           # the device arena's format
    device_block_bytes: int = 0     # bytes of one device block slot in that format
    num_waiting_for_kv: int = 0     # admitted, their prefix being loaded from the tiers
    step_tier_io_seconds: float = 0.0   # the step thread's time in tier calls (matches); the rest is on the worker
    transfer_load_seconds: float = 0.0  # the transfer worker's time loading (read, verify, decode)
    transfer_store_seconds: float = 0.0  # ... and storing (check, encode, put)
    num_tokens_computed: int = 0    # tokens through the forward (prompts, recomputed prefixes, decodes)
    num_blocks_loaded_from_tiers: int = 0   # prefixes of new requests and of preempted ones
    kv_offload: str = "off"         # the engine's default offload mode
    device_kv_bytes: int = 0        # the arena + the fetch area: never above the budget
    num_offloaded_running: int = 0  # running requests with blocks in host memory
    host_kv_bytes: int = 0          # their KV pinned in host memory now
    host_blocks_reserved: int = 0   # host slots set aside for the offloaded requests admitted
    offload_fetched_bytes: int = 0  # host -> device, all offloaded requests so far
    offload_fetch_seconds: float = 0.0
    offload_copied_bytes: int = 0   # host -> fetch area copies, and the time they took (overlapped or not)
    offload_copy_seconds: float = 0.0


class LLMEngine:
    def __init__(self, loaded, config: EngineConfig, manager=None) -> None:
        self.config = config
        self.manager = manager
        self.layout = loaded.kv_layout(config.block_tokens)
        model_config = loaded.model.config.get_text_config(decoder=True)
        check_engine(self.layout, config, model_config,  # every refusal, as a one-line ConfigError, before building
                     has_host_tier=manager is not None and manager.num_in_place_slots > 0)
        device = next(loaded.model.parameters()).device
        self.offload = config.offload_config()  # the settings, parsed once
        self.offload_mode = self.offload.mode
        # the host's peer of the block manager: offloaded requests' host slots, room and pins
        self.host_pool = HostBlockPool(manager, self.layout.block_bytes) if self.offload_mode is not None else None
        self.fetch = self._fetch_area(device) if self.offload_mode is not None else None
        arena_budget = config.device_kv_budget_bytes - (self.fetch.nbytes if self.fetch is not None else 0)
        self.arena = make_arena(self.layout, arena_budget, config.kv_codec, device=device,
                                max_open_blocks=config.max_num_seqs)
        self.num_blocks = self.arena.num_blocks
        self.codec = get_codec(config.codec)
        self.max_model_tokens = config.max_model_tokens or int(model_config.max_position_embeddings)
        self.block_manager = BlockManager(self.num_blocks)
        eos_token_ids = _eos_token_ids(loaded.model)
        self.offload_attention = (OffloadAttention(self.fetch, self.layout.num_layers, self.offload.page_tokens,
                                                   getattr(model_config, "num_attention_heads", None),
                                                   self.layout.num_kv_heads) if self.fetch is not None else None)
        self.runner = ModelRunner(loaded.model, self.layout, self.arena, eos_token_ids, self.offload_attention)
        self.vocab_size = int(self.runner.lm_head.out_features)
        space = KeySpace(loaded.fingerprint, self.layout, key_codec(self.codec.name, config.kv_codec))
        self.scheduler = Scheduler(
            self.block_manager, space,
            max_num_seqs=config.max_num_seqs, max_prefill_tokens=config.max_prefill_tokens,
            max_model_tokens=self.max_model_tokens, eos_token_ids=eos_token_ids,
            prefix_caching=config.prefix_caching, match_tiers=self._match_tiers if manager is not None else None,
            offload=self.offload)
        write_block = self.arena.write_block if self.arena.block_writes_off_thread else None
        self.transfer = (TierIO(manager, self.codec, write_block=write_block, host_pool=self.host_pool,
                                synchronous=config.synchronous_transfers) if manager is not None else None)
        self._seqs: dict[str, Sequence] = {}
        self.step_tier_io_seconds = 0.0
        self.num_tokens_computed = 0
        self.offload_fetched_bytes = 0
        self.offload_fetch_seconds = 0.0

    def _fetch_area(self, device) -> FetchArea:
        """The device memory host blocks are attended from, taken out of the budget."""
        layout = self.layout
        half = fetch_half_blocks(layout, self.offload, self.config.device_kv_budget_bytes)
        fetch = FetchArea(half, layout.num_kv_heads, layout.block_tokens, layout.head_dim,
                          getattr(torch, layout.dtype), device, self.offload.window_tokens)
        fetch.host = self.host_pool.payloads(getattr(torch, layout.dtype), layout.block_shape)
        return fetch

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    namespace: str = "") -> None:
        if request_id in self._seqs or self.scheduler.has_load_in_flight(request_id):
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self.check_request(len(prompt_token_ids), sampling.max_tokens)
        outside = [t for t in [*prompt_token_ids, *sampling.token_ids_used()] if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(f"token id {outside[0]} is outside the vocabulary ({self.vocab_size})")
        try:
            namespace.encode()  # block keys hash it as UTF-8
        except UnicodeEncodeError as exc:
            raise ValueError(f"the namespace (cache_salt) is not valid UTF-8: {exc}") from None
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), sampling, namespace)
        mode = self._offload_for(len(prompt_token_ids), sampling)
        if mode is not None:
            need = self._host_blocks_needed(len(prompt_token_ids) + sampling.max_tokens)
            self.host_pool.check_room(need)
            seq.host = HostBlocks(mode, need, stats=OffloadStats(mode=str(mode)))
            if mode.kind == "sparse":
                num_blocks = -(-(len(prompt_token_ids) + sampling.max_tokens) // self.layout.block_tokens)
                num_pages = self.layout.block_tokens // self.offload.page_tokens  # per block
                seq.host.summaries = torch.zeros((num_blocks, self.layout.num_layers, num_pages,
                                                  self.layout.num_kv_heads, PAGE_SUMMARY_VECTORS,
                                                  self.layout.head_dim),
                                                 dtype=getattr(torch, self.layout.dtype), device=self.arena.device)
                seq.host.stats.summary_bytes = seq.host.summaries.numel() * seq.host.summaries.element_size()
            self.host_pool.reserve(request_id, need)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    @property
    def max_device_tokens(self) -> int:
        """The longest sequence the device holds whole (the budget); longer ones need offload."""
        return self.num_blocks * self.layout.block_tokens

    @property
    def max_request_tokens(self) -> int:
        """The longest sequence (prompt + generated) this engine can hold: the context, and the device
        budget unless offload is on (engine default)."""
        return self.request_token_limit(None)

    def request_token_limit(self, kv_offload: str | None) -> int:
        """`max_request_tokens` for a request asking for `kv_offload` (None: the engine's default)."""
        offload = self.offload_mode if kv_offload is None else parse_offload(kv_offload)
        if offload is not None and self.fetch is not None:
            return self.max_model_tokens
        return min(self.max_model_tokens, self.max_device_tokens)

    def _offload_for(self, num_prompt_tokens: int, sampling: SamplingParams) -> OffloadMode | None:
        """The offload mode of a request, None when it runs whole on the device (it fits, or off)."""
        if self.fetch is None or num_prompt_tokens + sampling.max_tokens <= self.max_device_tokens:
            return None
        return self.offload_mode if sampling.kv_offload is None else parse_offload(sampling.kv_offload)

    def _host_blocks_needed(self, num_tokens: int) -> int:
        return self.offload.host_blocks_needed(num_tokens)

    @property
    def host_blocks_reserved(self) -> int:
        """Host slots set aside for the offloaded requests admitted (`HostBlockPool`)."""
        return self.host_pool.num_reserved if self.host_pool is not None else 0

    def check_request(self, num_prompt_tokens: int, max_tokens: int, kv_offload: str | None = None) -> None:
        """Raise ValueError (a message for the client) if such a request cannot run here:
        `ContextLengthError` when prompt + max_tokens exceeds `request_token_limit` — rejected, never
        clamped (a caller that wants "as much as fits" asks for `max_request_tokens - prompt`);
        `HostRoomError` when an offloaded request's host blocks do not fit the host memory."""
        if num_prompt_tokens <= 0:
            raise ValueError("the prompt is empty")
        if num_prompt_tokens >= self.max_model_tokens:
            raise ContextLengthError(f"the prompt has {num_prompt_tokens} tokens; this model's context is "
                                     f"{self.max_model_tokens} tokens", "prompt")
        if kv_offload is not None and parse_offload(kv_offload) is not None and self.fetch is None:
            raise OffloadUnavailableError("kv_offload: this server runs with offload off (start it with --kv-offload)")
        num_tokens, limit = num_prompt_tokens + max_tokens, self.request_token_limit(kv_offload)
        if num_tokens <= limit and num_tokens > self.max_device_tokens:
            self.host_pool.check_room(self._host_blocks_needed(num_tokens))
        if num_tokens <= limit:
            return
        room = max(limit - num_prompt_tokens, 0)
        where = (f"this model's context is {self.max_model_tokens} tokens" if limit == self.max_model_tokens else
                 f"the device KV budget ({self.num_blocks} blocks of {self.layout.block_tokens} tokens) "
                 f"holds {limit} tokens per request" + ("" if self.fetch is not None else
                                                         " (kv_offload serves longer ones: --kv-offload exact)"))
        param = "max_tokens" if room else "prompt"
        raise ContextLengthError(f"{where}; this request asks for {num_tokens} ({num_prompt_tokens} in the prompt "
                                 f"+ max_tokens {max_tokens}). Rejected, not clamped: "
                                 + (f"ask for at most {room} tokens" if room else "shorten the prompt"), param)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request wherever it is; False if it is not (or no longer) in the engine."""
        seq = self.scheduler.abort(request_id)
        self._forget(request_id)
        self._unpin()
        return seq is not None

    def request_ids(self) -> list[str]:
        return list(self._seqs)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def running_request_ids(self) -> list[str]:
        """The requests that can be in the next step (admitted, their KV on the device)."""
        return [seq.request_id for seq in self.scheduler.running]

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._finish_loads()
        out = self.scheduler.schedule()
        run = RunOutput()
        outputs = [self._output(seq, run) for seq in out.failed + self._execute(out, run)]
        if not out.chunks and self.scheduler.loads_in_flight():  # nothing computed: wait a little for a load
            self._finish_loads(timeout_s=0.05)
        newly_full = self.scheduler.take_newly_full()
        if self.config.tier_writes == "full":
            try:
                self._write_to_tiers(newly_full, chains=_extended_chains(out, newly_full))
            except Exception:  # noqa: BLE001 — the blocks stay on the device; the tokens are delivered
                log.exception("writing computed blocks to the tiers failed")
        for output in outputs:
            if output.finished:
                self._forget(output.request_id)
        self._unpin()
        self.arena.prune(lambda block_id: self.block_manager.ref_counts[block_id] > 0)
        return outputs

    def _execute(self, out: SchedulerOutput, run: RunOutput) -> list[Sequence]:
        """Move blocks, run the forward (its results land in `run`), advance the sequences; returns those
        with news (a token, or finished with an error). A failure costs the sequences of this step, never
        the others."""
        try:
            self._move_blocks(out)
        except Exception as exc:  # noqa: BLE001
            log.exception("moving KV blocks failed; failing the requests of this step")
            # tier loads were handed to the transfer worker first and register only once written (_finish_loads)
            return self._fail(out, f"moving KV blocks failed: {exc}")
        try:
            if out.chunks:
                result = self.runner.run(out.chunks)
                run.token_ids, run.errors, run.logprobs = result.token_ids, result.errors, result.logprobs
                self._add_prompt_logprobs(result.prompt_logprobs)
            self.num_tokens_computed += sum(chunk.num_tokens for chunk in out.chunks)
        except Exception as exc:  # noqa: BLE001 — the computed KV below the step's tokens is intact
            log.exception("the forward failed; failing the requests of this step")
            return self._fail(out, f"the forward failed: {exc}")
        return self.scheduler.postprocess(out, run.token_ids, run.errors)

    def _add_prompt_logprobs(self, computed: dict[str, tuple[int, list[TokenLogprob]]]) -> None:
        """Extend each sequence's prompt logprobs; positions it already has (computed again after a
        preemption) are skipped."""
        for request_id, (start, logprobs) in computed.items():
            seq = self._seqs.get(request_id)
            if seq is None or seq.prompt_logprobs is None:
                continue
            have = len(seq.prompt_logprobs) - (start + 1)  # entry i scores prompt token i
            seq.prompt_logprobs.extend(logprobs[max(have, 0):])

    def _fail(self, out: SchedulerOutput, error: str) -> list[Sequence]:
        """Finish the step's sequences with an error."""
        request_ids = [chunk.seq.request_id for chunk in out.chunks]
        failed = [self.scheduler.fail(request_id, error) for request_id in dict.fromkeys(request_ids)]
        return [seq for seq in failed if seq is not None]

    def _move_blocks(self, out: SchedulerOutput) -> None:
        # blocks leaving an offloaded sequence's device window go to host memory before anything
        # reuses their slots; an evicted block is copied out before the forward writes into its slot.
        try:
            for offload in out.offloads:
                self._offload_block(offload)
        finally:  # a failed offload fails this step's sequences, never the loads of the waiting ones
            # Tier loads only read the tiers now; their blocks are written by a later step's _finish_loads.
            # A load beside no forward (this step computes nothing) copies on the cores torch may use; one
            # beside a forward copies on one, leaving the forward's intra-op threads their cores.
            threads = copy_threads() if not out.chunks else 1
            for job in out.loads:
                job.copy_threads = threads
                self.transfer.load(job)
        # "full": evicted blocks were written when computed; only those the tiers no longer hold go again
        self._write_to_tiers(out.evicted, skip_held=self.config.tier_writes == "full")

    def _offload_block(self, offload: Offload) -> None:
        """Pin a block of an offloaded sequence in host memory (where DRAM holds it already, else
        copied from the device), with its key summary for sparse attention.

        Not a `BlockMover.save`, by design: a save is best-effort and later (queued on the writer, dropped when
        the queue is full, a miss at worst), answers "does any tier hold it" and holds nothing. This block's
        device slot is reused by this very step, so it must be in a DRAM slot *now* and stay there, leased,
        while the sequence attends to it (`HostBlockPool.pin`: "does DRAM hold it", on the step thread; a
        failure fails the step's sequences). What they can share they share: the encode (`BlockMover.encode`:
        the codec under a key-bound header) and the manager's store with write-through below
        (`TierManager.lease_in_place` stores as `put_many` does)."""
        host = offload.seq.host
        # encoded as a save encodes it, only where DRAM does not hold it yet (the block's save may have landed)
        slot = self.host_pool.pin(offload.key, lambda: self.transfer.mover.encode(
            offload.key, self.arena.block_tensor(offload.block_id)))
        summaries = [] if host.summaries is None else [page_summary(self.arena.k_cache[:, offload.block_id],
                                                                    self.offload.page_tokens)]
        self._add_host_blocks(host, [slot], [offload.key], summaries)

    def _take_host_blocks(self, seq: Sequence, pinned: PinnedInHost) -> None:
        """A load's host part, held in DRAM slots by the transfer worker: the offloaded sequence's
        blocks after its sink blocks, in order, with their key summaries for sparse attention. All or
        nothing: the summaries (device memory) are made before any block is taken."""
        host = seq.host
        summaries = [] if host.summaries is None else [
            page_summary(self.fetch.host[slot][:, 0].to(self.arena.device), self.offload.page_tokens)
            for slot in pinned.slots]
        self._add_host_blocks(host, pinned.slots, pinned.keys, summaries)

    def _add_host_blocks(self, host: HostBlocks, slots: list[int], keys: list[bytes],
                         summaries: list[torch.Tensor]) -> None:
        """Append blocks held in DRAM slots to a sequence's host blocks (`summaries`: sparse mode's, else [])."""
        for i, summary in enumerate(summaries):
            host.summaries[len(host.slots) + i] = summary
        host.slots += slots
        host.keys += keys
        host.stats.host_kv_bytes = max(host.stats.host_kv_bytes, len(host.slots) * self.layout.block_bytes)

    def _unpin(self) -> None:
        keys = self.scheduler.take_unpinned()
        if keys:
            self.host_pool.unpin(keys)

    def _finish_loads(self, timeout_s: float = 0.0) -> None:
        """Let the scheduler run the sequences whose tier loads finished. Blocks the worker returned
        decoded (arenas that take block writes on this thread only) are copied in first, never during
        a forward. A load for a request that ended meanwhile only frees its blocks (finish_load), its
        host slots and its host room."""
        if self.transfer is None:
            return
        for done in self.transfer.poll(timeout_s):
            try:
                self._finish_load(done)
            except Exception:  # noqa: BLE001 — a scheduler bug; the other loads still finish
                log.exception("finishing the tier load of request %s failed", done.request_id)
            finally:
                done.release()

    def _finish_load(self, done: LoadDone) -> None:
        num_loaded, host, host_tiers = done.num_written, done.host, []
        seq = self.scheduler.loading.get(done.request_id)
        if seq is None:  # the request ended meanwhile: nobody attends over its host blocks
            if self.host_pool is not None:
                self.host_pool.load_returned(done.request_id)
        else:
            num_loaded = self.transfer.write_decoded(done, self.arena.write_block)
            if host and num_loaded == len(done.block_ids):  # the host blocks follow a whole sink
                try:
                    self._take_host_blocks(seq, host)
                    host_tiers = host.tiers
                except Exception:  # noqa: BLE001 — computed instead
                    log.exception("taking a loaded prefix's host blocks failed")
        if host and not host_tiers:
            self.host_pool.unpin(host.keys)
        # registered only now that their KV is written
        self.scheduler.finish_load(done.request_id, num_loaded, done.tiers, host_tiers)

    def _write_to_tiers(self, blocks: list[tuple[bytes, int]], *, skip_held: bool = False,
                        chains: list[list[bytes]] = ()) -> None:
        """Copy device blocks out of the arena and hand them to the transfer worker, which encodes and
        writes them down. `skip_held`: the worker first asks the tiers and writes only the blocks none
        holds (dropped by a tier's LRU, or a write that never landed: a tier that was down, a full queue).
        `chains`: the sequences' chains the blocks extend, refreshed in the tiers with them."""
        if self.transfer is None or not blocks:
            return
        self.transfer.store([(key, self.arena.block_tensor(block_id)) for key, block_id in blocks], skip_held=skip_held,
                            chains=chains)

    def _match_tiers(self, keys: list[bytes]):
        start = time.perf_counter()
        try:
            return self.manager.match(keys, pin=True)  # pinned until the transfer worker has read them
        finally:
            self.step_tier_io_seconds += time.perf_counter() - start

    def _output(self, seq: Sequence, run: RunOutput) -> RequestOutput:
        failed = seq.finish_reason == "error"
        new_token_ids = [] if failed else [seq.token_ids[-1]]
        logprobs = prompt_logprobs = None
        if seq.sampling.logprobs is not None and not failed:
            logprobs = [run.logprobs[seq.request_id]]
        if seq.prompt_logprobs is not None and seq.num_generated_tokens == 1 and not failed:
            prompt_logprobs = list(seq.prompt_logprobs)
        return RequestOutput(seq.request_id, new_token_ids, seq.finish_reason is not None, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_cached_tokens, dict(seq.cached_tokens_by_tier), seq.error,
                             logprobs, prompt_logprobs, self._offload_stats(seq, new_token_ids))

    def _offload_stats(self, seq: Sequence, new_token_ids: list[int]) -> OffloadStats | None:
        """A copy of an offloaded request's stats, its window's device bytes and decode tokens counted."""
        if seq.host is None:
            return None
        stats = seq.host.stats
        stats.peak_device_kv_bytes = max(stats.peak_device_kv_bytes,
                                         seq.num_device_blocks * self.arena.block_bytes)
        if new_token_ids and seq.num_generated_tokens > 1:
            stats.num_decode_tokens += 1
        return OffloadStats(**{name: getattr(stats, name) for name in OffloadStats.__slots__})

    def _forget(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        self.runner.forget(request_id)
        if seq is not None and seq.host is not None:
            # a load in flight may still pin host slots: its room is kept till the load is back
            self.host_pool.release(request_id, load_in_flight=self.scheduler.has_load_in_flight(request_id))
            self.offload_fetched_bytes += seq.host.stats.fetched_bytes
            self.offload_fetch_seconds += seq.host.stats.fetch_seconds
            seq.host.reserved_blocks = 0

    # -- tiers and introspection -------------------------------------------------------------------
    def flush_to_tiers(self) -> int:
        """Write every cached device block to the tiers (e.g. before shutdown); returns how many."""
        if self.transfer is None:
            return 0
        before = self.transfer.stats.num_blocks_written
        self._write_to_tiers(self.block_manager.cached_blocks(), skip_held=self.config.tier_writes == "full")
        self.transfer.wait()
        return self.transfer.stats.num_blocks_written - before

    def wait_for_transfers(self) -> None:
        """Until every tier load and store handed to the transfer worker has landed."""
        if self.transfer is not None:
            self.transfer.wait()

    def close(self) -> None:
        """Finish pending tier writes and stop the transfer worker (the manager stays open)."""
        if self.transfer is not None:
            self.transfer.close()
            for done in self.transfer.poll():  # loads nobody will run: their leases and host slots go back
                if self.host_pool is not None:
                    self.host_pool.unpin(done.host.keys)
                done.release()
        if self.fetch is not None:
            self.fetch.close()

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        ts = self.transfer.stats if self.transfer is not None else None
        return EngineStats(len(s.running), len(s.waiting), bm.num_used_blocks,
                           len(bm.cached_free), bm.num_blocks, s.num_preemptions,
                           ts.num_blocks_written if ts else 0, dict(s.prefix_hit_tokens_by_tier), self.arena.codec,
                           self.arena.block_bytes, len(s.loading), self.step_tier_io_seconds,
                           ts.load_seconds if ts else 0.0, ts.store_seconds if ts else 0.0,
                           self.num_tokens_computed, ts.num_blocks_loaded if ts else 0,
                           str(self.offload_mode or "off"), self.device_kv_bytes, *self._offload_now(),
                           self.fetch.copied_bytes if self.fetch else 0, self.fetch.copy_seconds if self.fetch else 0.0)

    @property
    def device_kv_bytes(self) -> int:
        """What the device KV takes: the arena and the fetch area, allocated once within the budget."""
        return self.arena.nbytes + (self.fetch.nbytes if self.fetch is not None else 0)

    def _offload_now(self) -> tuple[int, int, int, int, float]:
        running = [seq for seq in self._seqs.values() if seq.host is not None and seq.host.slots]
        live = [seq.host.stats for seq in self._seqs.values() if seq.host is not None]
        return (len(running), sum(len(seq.host.slots) for seq in running) * self.layout.block_bytes,
                self.host_blocks_reserved, self.offload_fetched_bytes + sum(s.fetched_bytes for s in live),
                self.offload_fetch_seconds + sum(s.fetch_seconds for s in live))

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, namespace: str = "") -> list[list[int]]:
        """Run prompts to completion together; the generated token ids of each (offline use, tests)."""
        ids = [f"offline-{id(self)}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            self.add_request(request_id, prompt, sampling, namespace)
        generated: dict[str, list[int]] = {request_id: [] for request_id in ids}
        while self.has_unfinished_requests():
            for output in self.step():
                generated[output.request_id] += output.new_token_ids
        self.wait_for_transfers()  # offline: finished means the blocks are down in the tiers too
        return [generated[request_id] for request_id in ids]


def _extended_chains(out: SchedulerOutput, newly_full: list[tuple[bytes, int]]) -> list[list[bytes]]:
    """The chains a step's new full blocks extend: the blocks so far (root first) of each scheduled sequence
    whose last keyed block is new. A save carries only the new blocks; the tiers refresh the rest with them."""
    if not newly_full:
        return []
    new = {key for key, _ in newly_full}
    seqs = {chunk.seq.request_id: chunk.seq for chunk in out.chunks}
    return [seq.block_keys for seq in seqs.values()  # the copy of a chain only where its last block is new
            if seq.key_chain is not None and seq.num_keyed_blocks
            and seq.key_chain.keys[seq.num_keyed_blocks - 1] in new]


def _eos_token_ids(model) -> tuple[int, ...]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
