"""`LLMEngine`: the synchronous core — schedule, move blocks, run, postprocess — nano-vllm style.

The engine is the only caller of the tier manager while serving. The step thread only asks the
tiers which blocks they hold (`TierManager.match`, at admission); every read, verify, decode, encode
and write runs on the transfer worker (`engine/transfer.py`). Each block goes down once, as soon as
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
from typing import Literal, get_args

from kvtier.blocks import KeySpace, key_codec
from kvtier.codecs import get_codec
from kvtier.engine.arena import ARENA_CODECS, KVFormat, make_arena
from kvtier.engine.block_manager import BlockManager
from kvtier.engine.model_runner import ModelRunner, RunOutput
from kvtier.engine.scheduler import Scheduler, SchedulerOutput
from kvtier.engine.sequence import SamplingParams, Sequence
from kvtier.engine.transfer import KVTransfer

_MiB = 1 << 20
TierWrites = Literal["full", "evict"]       # blocks go to the tiers when computed, or when the device evicts them

log = logging.getLogger(__name__)


class ContextLengthError(ValueError):
    """A request longer than the engine can ever hold (the message is for the client). `param` is
    the request field to change: "prompt" or "max_tokens"."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class EngineConfig:
    device_kv_budget_bytes: int = 512 * _MiB
    block_tokens: int = 256
    max_num_seqs: int = 32
    max_prefill_tokens: int = 512   # chunked prefill: prompt tokens computed per step, all sequences together
    prefix_caching: bool = True
    codec: str = "raw"              # how blocks are written to the tiers
    tier_writes: TierWrites = "full"  # "full": each block as soon as it is computed; "evict": when the device evicts it
    kv_codec: KVFormat = "raw"      # the format resident on the device: raw, fp8, int8, int4, int2 (arena)
    max_model_tokens: int | None = None  # default: the model's max_position_embeddings
    synchronous_transfers: bool = False  # tier I/O at submission on the step thread (tests, debugging)

    def __post_init__(self) -> None:
        if self.tier_writes not in get_args(TierWrites):
            raise ValueError(f"tier_writes must be 'full' or 'evict', got {self.tier_writes!r}")
        if self.kv_codec not in ARENA_CODECS:
            raise ValueError(f"kv_codec must be one of {', '.join(ARENA_CODECS)}, got {self.kv_codec!r}")
        for name in ("device_kv_budget_bytes", "block_tokens", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EngineConfig.{name} must be positive, got {getattr(self, name)}")


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


class LLMEngine:
    def __init__(self, loaded, config: EngineConfig, manager=None) -> None:
        self.config = config
        self.manager = manager
        self.layout = loaded.kv_layout(config.block_tokens)
        device = next(loaded.model.parameters()).device
        self.arena = make_arena(self.layout, config.device_kv_budget_bytes, config.kv_codec, device=device,
                                max_open_blocks=config.max_num_seqs)
        self.num_blocks = self.arena.num_blocks
        self.codec = get_codec(config.codec)
        model_config = loaded.model.config.get_text_config(decoder=True)
        _require_full_attention(model_config)
        self.max_model_tokens = config.max_model_tokens or int(model_config.max_position_embeddings)
        self.block_manager = BlockManager(self.num_blocks)
        self.runner = ModelRunner(loaded.model, self.layout, self.arena)
        space = KeySpace(loaded.fingerprint, self.layout, key_codec(self.codec.name, config.kv_codec))
        self.scheduler = Scheduler(
            self.block_manager, space,
            max_num_seqs=config.max_num_seqs, max_prefill_tokens=config.max_prefill_tokens,
            max_model_tokens=self.max_model_tokens, eos_token_ids=_eos_token_ids(loaded.model),
            prefix_caching=config.prefix_caching, match_tiers=self._match_tiers if manager is not None else None)
        write_block = self.arena.write_block if self.arena.block_writes_off_thread else None
        self.transfer = (KVTransfer(manager, self.codec, write_block=write_block,
                                    synchronous=config.synchronous_transfers) if manager is not None else None)
        self._seqs: dict[str, Sequence] = {}
        self.step_tier_io_seconds = 0.0
        self.num_tokens_computed = 0

    # -- requests --------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    namespace: str = "") -> None:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        self.check_request(len(prompt_token_ids), sampling.max_tokens)
        try:
            namespace.encode()  # block keys hash it as UTF-8
        except UnicodeEncodeError as exc:
            raise ValueError(f"the namespace (cache_salt) is not valid UTF-8: {exc}") from None
        seq = Sequence(request_id, list(prompt_token_ids), len(prompt_token_ids), sampling, namespace)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    @property
    def max_request_tokens(self) -> int:
        """The longest sequence (prompt + generated) this engine can hold: context and device budget."""
        return min(self.max_model_tokens, self.num_blocks * self.layout.block_tokens)

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError (a message for the client) if such a request can never run here:
        `ContextLengthError` when prompt + max_tokens exceeds `max_request_tokens` — rejected, never
        clamped (a caller that wants "as much as fits" asks for `max_request_tokens - prompt`)."""
        if num_prompt_tokens <= 0:
            raise ValueError("the prompt is empty")
        if num_prompt_tokens >= self.max_model_tokens:
            raise ContextLengthError(f"the prompt has {num_prompt_tokens} tokens; this model's context is "
                                     f"{self.max_model_tokens} tokens", "prompt")
        num_tokens, limit = num_prompt_tokens + max_tokens, self.max_request_tokens
        if num_tokens <= limit:
            return
        room = max(limit - num_prompt_tokens, 0)
        where = (f"this model's context is {self.max_model_tokens} tokens" if limit == self.max_model_tokens else
                 f"the device KV budget ({self.num_blocks} blocks of {self.layout.block_tokens} tokens) "
                 f"holds {limit} tokens per request")
        param = "max_tokens" if room else "prompt"
        raise ContextLengthError(f"{where}; this request asks for {num_tokens} ({num_prompt_tokens} in the prompt "
                                 f"+ max_tokens {max_tokens}). Rejected, not clamped: "
                                 + (f"ask for at most {room} tokens" if room else "shorten the prompt"), param)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request wherever it is; False if it is not (or no longer) in the engine."""
        seq = self.scheduler.abort(request_id)
        self._forget(request_id)
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
        outputs = [self._output(seq) for seq in out.failed + self._execute(out)]
        if not out.chunks and self.scheduler.loading:  # nothing computed: wait a little for a load to land
            self._finish_loads(timeout_s=0.05)
        newly_full = self.scheduler.take_newly_full()
        if self.config.tier_writes == "full":
            try:
                self._write_to_tiers(newly_full)
            except Exception:  # noqa: BLE001 — the blocks stay on the device; the tokens are delivered
                log.exception("writing computed blocks to the tiers failed")
        for output in outputs:
            if output.finished:
                self._forget(output.request_id)
        self.arena.prune(lambda block_id: self.block_manager.ref_counts[block_id] > 0)
        return outputs

    def _execute(self, out: SchedulerOutput) -> list[Sequence]:
        """Move blocks, run the forward, advance the sequences; returns those with news (a token, or
        finished with an error). A failure costs the sequences of this step, never the others."""
        try:
            self._move_blocks(out)
        except Exception as exc:  # noqa: BLE001
            log.exception("moving KV blocks failed; failing the requests of this step")
            # tier loads were handed to the transfer worker first and register only once written (_finish_loads)
            return self._fail(out, f"moving KV blocks failed: {exc}")
        try:
            run = self.runner.run(out.chunks) if out.chunks else RunOutput()
            self.num_tokens_computed += sum(chunk.num_tokens for chunk in out.chunks)
        except Exception as exc:  # noqa: BLE001 — the computed KV below the step's tokens is intact
            log.exception("the forward failed; failing the requests of this step")
            return self._fail(out, f"the forward failed: {exc}")
        return self.scheduler.postprocess(out, run.token_ids, run.errors)

    def _fail(self, out: SchedulerOutput, error: str) -> list[Sequence]:
        """Finish the step's sequences with an error."""
        request_ids = [chunk.seq.request_id for chunk in out.chunks]
        failed = [self.scheduler.fail(request_id, error) for request_id in dict.fromkeys(request_ids)]
        return [seq for seq in failed if seq is not None]

    def _move_blocks(self, out: SchedulerOutput) -> None:
        # an evicted block is copied out before the forward writes into its slot (reallocated this step).
        # Tier loads only read the tiers now; their blocks are written by a later step's _finish_loads.
        for job in out.loads:
            self.transfer.load(job)
        # "full": evicted blocks were written when computed; only those the tiers no longer hold go again
        self._write_to_tiers(out.evicted, skip_held=self.config.tier_writes == "full")

    def _finish_loads(self, timeout_s: float = 0.0) -> None:
        """Let the scheduler run the sequences whose tier loads finished. Blocks the worker returned
        decoded (arenas that take block writes on this thread only) are copied in first, never during
        a forward. A load for a request that ended meanwhile only frees its blocks (finish_load)."""
        if self.transfer is None:
            return
        for done in self.transfer.poll(timeout_s):
            try:
                num_loaded = done.num_written
                if done.request_id in self.scheduler.loading:
                    try:
                        for block_id, block in zip(done.block_ids[num_loaded:], done.blocks):
                            self.arena.write_block(block_id, block)
                            num_loaded += 1
                    except Exception:  # noqa: BLE001 — the rest of its prompt is computed instead
                        log.exception("copying a loaded prefix into the device failed")
                # registered only now that their KV is written
                self.scheduler.finish_load(done.request_id, num_loaded, done.tiers)
            finally:
                done.release()

    def _write_to_tiers(self, blocks: list[tuple[bytes, int]], *, skip_held: bool = False) -> None:
        """Copy device blocks out of the arena and hand them to the transfer worker, which encodes and
        writes them down. `skip_held`: the worker first asks the tiers and writes only the blocks none
        holds (dropped by a tier's LRU, or a write that never landed: a tier that was down, a full queue)."""
        if self.transfer is None or not blocks:
            return
        self.transfer.store([(key, self.arena.block_tensor(block_id)) for key, block_id in blocks], skip_held=skip_held)

    def _match_tiers(self, keys: list[bytes]):
        start = time.perf_counter()
        try:
            return self.manager.match(keys, pin=True)  # pinned until the transfer worker has read them
        finally:
            self.step_tier_io_seconds += time.perf_counter() - start

    def _output(self, seq: Sequence) -> RequestOutput:
        new_token_ids = [] if seq.finish_reason == "error" else [seq.token_ids[-1]]
        return RequestOutput(seq.request_id, new_token_ids, seq.finish_reason is not None, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_cached_tokens, dict(seq.cached_tokens_by_tier), seq.error)

    def _forget(self, request_id: str) -> None:
        self._seqs.pop(request_id, None)
        self.runner.forget(request_id)

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

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        ts = self.transfer.stats if self.transfer is not None else None
        return EngineStats(len(s.running), len(s.waiting), bm.num_used_blocks,
                           len(bm.cached_free), bm.num_blocks, s.num_preemptions,
                           ts.num_blocks_written if ts else 0, dict(s.prefix_hit_tokens_by_tier), self.arena.codec,
                           self.arena.block_bytes, len(s.loading), self.step_tier_io_seconds,
                           ts.load_seconds if ts else 0.0, ts.store_seconds if ts else 0.0,
                           self.num_tokens_computed, ts.num_blocks_loaded if ts else 0)

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


def _require_full_attention(config) -> None:
    # paged_attention attends to every cached token: a sliding-window layer would see too much
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if any(kind != "full_attention" for kind in layer_types) or sliding:
        raise ValueError("the engine serves full-attention models only (this one has sliding-window layers)")


def _eos_token_ids(model) -> tuple[int, ...]:
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
