"""`kvtier bench long`: contexts larger than the device (issue 18), on one small device KV budget.

Workload (SmolLM2, fp32 KV; real text): scenario `long` is one request of `long_tokens` prompt tokens,
scenario `concurrent` is `concurrent` requests of `concurrent_tokens` each, submitted together; scenario
`repeat` (not run by default) is the `long` request sent again after it finished, to the same engine (a
chat's next turn over the same document): its row is the second request's, which reuses the first's
prefix (an offloaded request's middle blocks pinned where the DRAM tier holds them). Every
prompt is a passkey prompt (`kvtier.evals.passkey`'s intro, needle, question and cue) whose filler is
tinyshakespeare (each request its own passage, the needle at its own depth, in the middle blocks that
offload sends to host memory); every request greedy-decodes `max_tokens` tokens, EOS ignored.

Systems, each on the same prompts, one after the other in one process:
- `vllm`: vLLM's CPU build (`.venv-vllm`) started with a KV space of the device budget and the model's
  context; it refuses at start (its message is recorded verbatim) — the status quo;
- `reference`: kvtier's engine with everything on the device (a budget that holds every request);
- `exact`: the device budget, `kv_offload="exact"`: sinks + recent window in the arena, the middle in
  the DRAM tier, attended to through the fetch area (counted in the budget) by prefill chunks; on the CPU
  decodes read it in place (`kvtier.offload.in_place`: no copy, so no decode copy rate);
- `sparse:B`: the same with Quest top-B blocks per layer and KV head at each decode step.

Measured per system and scenario: TTFT (submission to first token), decode tokens/s (steps in which
every request decodes), device KV allocated (`EngineStats.device_kv_bytes`), device KV in use at peak
(blocks used x block bytes + the fetch area, every step), each request's `peak_device_kv_bytes`, host ->
device bytes per decode token (`OffloadStats`), the copy rate of the decode fetches (the fetch area's
gathers timed where they run: bytes / seconds), greedy agreement with `reference` (the leading tokens
equal, as a fraction) and passkey accuracy. After each offloaded system, the same host memory is read
again by a warm, best-of-several strided copy (`dst.copy_` of each layer's slot range into a
pre-touched buffer of a fetch piece's shape, no index) of the bytes one exact decode step moves, and a
plain contiguous memcpy of as many bytes: the physical limits the fetch is held against.

Targets (issue 18; evaluated, never asserted): device KV never above the budget; exact token-identical
to the reference, its decode at the long context >= 50% of the reference's tokens/s and its copy >= 80%
of the strided copy; sparse at 1/8 moving <= 1/8 of exact's bytes per decode token; every concurrent
request completes.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np


SYSTEMS = ("vllm", "reference", "exact", "sparse")
SCENARIOS = ("long", "concurrent")
ALL_SCENARIOS = (*SCENARIOS, "repeat")
DEFAULT_BUDGETS = ("1/32", "1/16", "1/8", "1/4")


@dataclass(slots=True)
class LongSetup:
    long_tokens: int = 8192
    concurrent: int = 4
    concurrent_tokens: int = 6144
    max_tokens: int = 32
    budgets: tuple[str, ...] = DEFAULT_BUDGETS
    device_tokens: int = 1024      # the device KV budget, the fetch area included
    block_tokens: int = 64
    sink_blocks: int = 1
    recent_blocks: int = 2
    fetch_blocks: int = 15         # layer-blocks per half of the fetch area
    max_prefill_tokens: int = 512
    systems: tuple[str, ...] = SYSTEMS
    scenarios: tuple[str, ...] = SCENARIOS
    copy_repeats: int = 5
    model: str = "smollm2"
    seed: int = 0

    def system_names(self) -> list[str]:
        """`sparse` expands to one system per budget; `vllm` first (it refuses at start, quickly)."""
        names = []
        for system in self.systems:
            names += [f"sparse:{b}" for b in self.budgets] if system == "sparse" else [system]
        return names

    def prompt_lengths(self, scenario: str) -> list[int]:
        return [self.long_tokens] if scenario in ("long", "repeat") else [self.concurrent_tokens] * self.concurrent


@dataclass(slots=True)
class RequestResult:
    prompt_tokens: int
    token_ids: list[int]
    passkey: int
    answer: str
    correct: bool
    ttft_s: float
    finish_reason: str | None
    error: str | None = None
    peak_device_kv_bytes: int = 0    # its device window at its largest (offloaded requests)
    host_kv_bytes: int = 0
    fetched_bytes_per_token: float = 0.0
    fetch_wait_s: float = 0.0        # the step thread waiting for fetches (not hidden by compute)
    cached_tokens: int = 0           # prompt tokens found cached at admission (device, or the tiers)


@dataclass(slots=True)
class LongRow:
    system: str
    scenario: str
    requests: list[RequestResult] = field(default_factory=list)
    budget_bytes: int = 0
    device_kv_bytes: int = 0          # allocated: arena + fetch area (EngineStats.device_kv_bytes)
    peak_device_kv_used_bytes: int = 0  # blocks in use x block bytes + the fetch area, at the largest step
    fetch_area_bytes: int = 0
    decode_tokens: int = 0            # in steps where every unfinished request decodes
    decode_s: float = 0.0
    copy_bytes: int = 0               # host -> device by those steps (the fetch area's gathers)
    copy_s: float = 0.0               # the gathers' own time (on the fetch thread when exact)
    fetch_alone_gb_s: float = 0.0     # the same bytes by the fetch area's own gathers, with nothing beside them
    strided_copy_gb_s: float = 0.0    # the same bytes by a warm strided copy of the same host memory
    memcpy_gb_s: float = 0.0          # ... and by a contiguous memcpy
    wall_s: float = 0.0
    message: str = ""                 # vllm: its refusal, verbatim; else notes
    first_ttft_s: float = 0.0         # repeat: the first request's TTFT (it computed the prompt)
    block_tokens: int = 0
    recent_blocks: int = 0
    agreement: list[float] = field(default_factory=list)  # per request, vs reference: leading tokens equal

    # -- derived -------------------------------------------------------------------------------
    @property
    def completed(self) -> int:
        return sum(1 for r in self.requests if r.error is None and r.finish_reason in ("length", "stop"))

    @property
    def ttft_s(self) -> float:
        return statistics.mean(r.ttft_s for r in self.requests) if self.requests else math.nan

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else math.nan

    @property
    def fetched_bytes_per_token(self) -> float:
        return statistics.mean(r.fetched_bytes_per_token for r in self.requests) if self.requests else 0.0

    @property
    def copy_gb_s(self) -> float:
        return self.copy_bytes / self.copy_s / 1e9 if self.copy_s else math.nan

    @property
    def request_peak_device_kv_bytes(self) -> int:
        return max((r.peak_device_kv_bytes for r in self.requests), default=0)

    @property
    def passkey_accuracy(self) -> float:
        return sum(r.correct for r in self.requests) / len(self.requests) if self.requests else math.nan

    @property
    def identical(self) -> bool | None:
        return all(a == 1.0 for a in self.agreement) if self.agreement else None

    @property
    def within_budget(self) -> bool | None:
        """Allocated, used at peak and every request's window within the budget (offloaded systems)."""
        if not self.system.startswith(("exact", "sparse")):
            return None
        return max(self.device_kv_bytes, self.peak_device_kv_used_bytes,
                   self.request_peak_device_kv_bytes) <= self.budget_bytes

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("completed", "ttft_s", "decode_tokens_per_s", "fetched_bytes_per_token", "copy_gb_s",
                     "request_peak_device_kv_bytes", "passkey_accuracy", "identical", "within_budget"):
            out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> LongRow:
        names = set(cls.__dataclass_fields__)
        row = cls(**{k: v for k, v in data.items() if k in names and k != "requests"})
        row.requests = [RequestResult(**r) for r in data.get("requests", [])]
        return row


# -- prompts ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class LongPrompt:
    token_ids: list[int]
    passkey: int
    depth: float


def passkey_prompt(encode: Callable[[str], list[int]], text: str, num_tokens: int, depth: float, passkey: int,
                   offset: int) -> LongPrompt:
    """`num_tokens` tokens: the passkey test's intro, tinyshakespeare from character `offset` as the
    filler with the needle at `depth` of it, the question and the cue (ids concatenated piece by piece).
    The needle and the question stand in paragraphs of their own: in running verse SmolLM2-135M answers
    with more verse even at 1k tokens, set apart it finds the key."""
    from kvtier.evals.passkey import CUE, INTRO, NEEDLE, QUESTION

    head, needle = encode(INTRO), encode("\n\n" + NEEDLE.format(key=passkey).strip() + "\n\n")
    tail = encode("\n\n" + QUESTION.strip()) + encode(CUE)
    num_filler = num_tokens - len(head) - len(needle) - len(tail)
    if num_filler <= 0:
        raise ValueError(f"a {num_tokens}-token passkey prompt has no room for filler")
    filler = encode(text[offset:offset + num_filler * 8])[:num_filler]
    if len(filler) < num_filler:
        raise ValueError("the text is too short for such a prompt")
    cut = round(num_filler * depth)
    return LongPrompt(head + filler[:cut] + needle + filler[cut:] + tail, passkey, depth)


def make_prompts(encode: Callable[[str], list[int]], text: str, lengths: list[int], seed: int = 0) -> list[LongPrompt]:
    """One prompt per length, each its own passage and key, the needle at depths spread over (0.2, 0.8)."""
    rng = random.Random(seed)
    n = len(lengths)
    depths = [0.5] if n == 1 else [0.2 + 0.6 * i / (n - 1) for i in range(n)]
    stride = max(1, (len(text) - max(lengths) * 8) // n)
    return [passkey_prompt(encode, text, length, depth, rng.randint(10000, 99999), i * stride)
            for i, (length, depth) in enumerate(zip(lengths, depths))]


def agreement(tokens: list[int], reference: list[int]) -> float:
    """The fraction of the reference's tokens that `tokens` reproduces before the first difference."""
    if not reference:
        return 1.0 if not tokens else 0.0
    same = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        same += 1
    return same / len(reference)


def compare_to_reference(rows: list[LongRow]) -> None:
    """Fill each row's `agreement` from the `reference` row of its scenario run on the same prompts
    (the same number of requests of the same lengths: prompts are deterministic, so rows saved by
    different runs compare too)."""
    for ref in [r for r in rows if r.system == "reference" and r.requests]:
        ref.agreement = []
        lengths = [q.prompt_tokens for q in ref.requests]
        for row in rows:
            if row is not ref and row.scenario == ref.scenario and [q.prompt_tokens for q in row.requests] == lengths:
                row.agreement = [agreement(q.token_ids, r.token_ids) for q, r in zip(row.requests, ref.requests)]


# -- the copies a fetch is held against -------------------------------------------------------------
class CopyClock:
    """The fetch area's own copy counters (`FetchArea.copied_bytes` / `copy_seconds`, kept on whichever
    thread copies): bytes and seconds since the last `take`."""

    def __init__(self, fetch) -> None:
        self.fetch = fetch
        self._seen = (fetch.copied_bytes, fetch.copy_seconds)

    def take(self) -> tuple[int, float]:
        now = (self.fetch.copied_bytes, self.fetch.copy_seconds)
        out, self._seen = (now[0] - self._seen[0], now[1] - self._seen[1]), now
        return out


def strided_copy(host: torch.Tensor, num_slots: int, half_blocks: int, repeats: int) -> tuple[int, float]:
    """What one exact decode step moves (every layer of `num_slots` host blocks, in pieces of
    `half_blocks`), moved by plain strided copies from the same host memory `host` [slots, L, 2, H, T, D]
    into a pre-touched buffer: (bytes, best seconds of `repeats`)."""
    num_layers, (two, h, t, d) = host.shape[1], host.shape[2:]
    import torch

    dst = torch.ones((two, h, half_blocks, t, d), dtype=host.dtype)
    num_slots = min(num_slots, host.shape[0])

    def once() -> float:
        start = time.perf_counter()
        for layer in range(num_layers):
            source = host[:, layer].permute(1, 2, 0, 3, 4)  # [2, H, slots, T, D]
            for i in range(0, num_slots, half_blocks):
                n = min(half_blocks, num_slots - i)
                dst[:, :, :n].copy_(source[:, :, i:i + n])
        return time.perf_counter() - start

    once()  # warm
    num_bytes = num_layers * num_slots * two * h * t * d * host.element_size()
    return num_bytes, min(once() for _ in range(repeats))


def fetch_alone(fetch, num_slots: int, repeats: int) -> tuple[int, float]:
    """What one exact decode step moves (every layer of `num_slots` host blocks, in pieces of a fetch
    half), moved by the engine's own `FetchArea.gather` on this thread with nothing running beside it
    (in a step the gathers share the cores with the forward): (bytes, best seconds of `repeats`). Run
    after the engine's own run: it adds to the fetch area's copy counters, which the row has read."""
    import torch

    host = fetch.host
    num_layers, h = host.shape[1], host.shape[3]
    slots = torch.arange(min(num_slots, host.shape[0]))

    def once() -> float:
        start = time.perf_counter()
        for layer in range(num_layers):
            for i in range(0, slots.numel(), fetch.half_blocks):
                fetch.gather(layer, slots[i:i + fetch.half_blocks, None].expand(-1, h), half=0)
        return time.perf_counter() - start

    once()  # warm
    best = min(once() for _ in range(repeats))
    return num_layers * slots.numel() * host[0, 0].numel() * host.element_size(), best


def contiguous_memcpy(num_bytes: int, repeats: int) -> float:
    """Best seconds of a warm numpy memcpy of `num_bytes` between pre-touched buffers."""
    src = np.ones(num_bytes, dtype=np.uint8)
    dst = np.zeros(num_bytes, dtype=np.uint8)
    np.copyto(dst, src)
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best


# -- one engine run ---------------------------------------------------------------------------------
def engine_config(setup: LongSetup, layout, system: str, scenario: str):
    from kvtier.engine import EngineConfig

    common = dict(block_tokens=setup.block_tokens, max_num_seqs=max(setup.concurrent, 1),
                  max_prefill_tokens=setup.max_prefill_tokens)
    if system == "reference":  # every request whole on the device, + a block each to spare
        num_blocks = sum(-(-(n + setup.max_tokens) // setup.block_tokens) + 1 for n in setup.prompt_lengths(scenario))
        return EngineConfig(device_kv_budget_bytes=num_blocks * layout.block_bytes, **common)
    return EngineConfig(device_kv_budget_bytes=setup.device_tokens * layout.bytes_per_token, kv_offload=system,
                        offload_sink_blocks=setup.sink_blocks, offload_recent_blocks=setup.recent_blocks,
                        offload_fetch_blocks=setup.fetch_blocks, **common)


def host_manager(setup: LongSetup, layout, scenario: str):
    """A DRAM tier that holds every block of the scenario's requests (written through and pinned)."""
    from kvtier.codecs import get_codec
    from kvtier.tiers.manager import build_manager

    slot = get_codec("raw").max_encoded_bytes(layout)
    num_blocks = sum(-(-(n + setup.max_tokens) // setup.block_tokens) for n in setup.prompt_lengths(scenario)) + 16
    return build_manager([f"dram:{num_blocks * slot}"], slot_bytes=slot)


def run_engine(loaded, setup: LongSetup, system: str, scenario: str, prompts: list[LongPrompt], decode,
               progress: Callable[[str, int, int], None]) -> LongRow:
    """Submit every prompt at once, step to the end; the row (agreement is filled in by the caller)."""
    from kvtier.engine import LLMEngine, SamplingParams

    layout = loaded.kv_layout(setup.block_tokens)
    config = engine_config(setup, layout, system, scenario)
    manager = host_manager(setup, layout, scenario) if system != "reference" else None
    engine = LLMEngine(loaded, config, manager)
    clock = CopyClock(engine.fetch) if engine.fetch is not None else None
    row = LongRow(system, scenario, budget_bytes=config.device_kv_budget_bytes, device_kv_bytes=engine.device_kv_bytes,
                  block_tokens=setup.block_tokens, recent_blocks=setup.recent_blocks, fetch_area_bytes=engine.fetch.nbytes if engine.fetch is not None else 0)
    try:
        if scenario == "repeat":  # the first request computes the prompt; the row is the second's
            first = LongRow(system, "repeat-first")
            _drive(engine, first, prompts, setup, clock, SamplingParams, progress)
            row.first_ttft_s = first.ttft_s
        _drive(engine, row, prompts, setup, clock, SamplingParams, progress)
        if clock is not None and row.copy_bytes:  # the physical limits, on the same host memory, right after
            _copy_limits(engine, row, setup)
    finally:
        engine.close()
        if manager is not None:
            manager.close()
    from kvtier.evals.passkey import is_correct

    for r, prompt in zip(row.requests, prompts):
        r.answer = decode(r.token_ids)
        r.correct = is_correct(r.answer, prompt.passkey)
    return row


def _drive(engine, row: LongRow, prompts: list[LongPrompt], setup: LongSetup, clock: CopyClock | None,
           SamplingParams, progress) -> None:
    ids = [f"{row.system}-{row.scenario}-{i}" for i in range(len(prompts))]
    generated: dict[str, list[int]] = {i: [] for i in ids}
    first: dict[str, float] = {}
    done: dict[str, object] = {}
    total = sum(len(p.token_ids) for p in prompts) + setup.max_tokens * len(prompts)
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt.token_ids, SamplingParams(max_tokens=setup.max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        decoding = all(i in first for i in ids if i not in done)  # every unfinished request past its prefill
        if clock is not None:
            clock.take()
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        stats = engine.stats()
        used = stats.num_device_blocks_used * stats.device_block_bytes + row.fetch_area_bytes
        row.peak_device_kv_used_bytes = max(row.peak_device_kv_used_bytes, used)
        new_tokens = 0
        for out in outputs:
            generated[out.request_id] += out.new_token_ids
            new_tokens += len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = out
        if decoding and new_tokens:
            row.decode_tokens += new_tokens
            row.decode_s += now - step_start
            if clock is not None:
                num_bytes, seconds = clock.take()
                row.copy_bytes += num_bytes
                row.copy_s += seconds
        progress(f"{row.system} {row.scenario}", stats.num_tokens_computed, total)
    row.wall_s = time.perf_counter() - start
    for request_id, prompt in zip(ids, prompts):
        out = done[request_id]
        stats = out.offload
        row.requests.append(RequestResult(
            len(prompt.token_ids), generated[request_id], prompt.passkey, "", False,
            first.get(request_id, math.nan) - start, out.finish_reason, out.error,
            stats.peak_device_kv_bytes if stats else 0, stats.host_kv_bytes if stats else 0,
            stats.fetched_bytes_per_token if stats else 0.0, stats.fetch_seconds if stats else 0.0,
            out.num_cached_tokens))


def _copy_limits(engine, row: LongRow, setup: LongSetup) -> None:
    """The bytes of one exact decode step of the longest request, copied warm from the same host memory."""
    longest = max(row.requests, key=lambda r: r.host_kv_bytes)
    num_slots = longest.host_kv_bytes // engine.layout.block_bytes
    if not num_slots:
        return
    num_bytes, seconds = strided_copy(engine.fetch.host, num_slots, engine.fetch.half_blocks, setup.copy_repeats)
    row.strided_copy_gb_s = num_bytes / seconds / 1e9
    fetched, seconds = fetch_alone(engine.fetch, num_slots, setup.copy_repeats)
    row.fetch_alone_gb_s = fetched / seconds / 1e9
    row.memcpy_gb_s = num_bytes / contiguous_memcpy(num_bytes, setup.copy_repeats) / 1e9


# -- vLLM at the same budget -------------------------------------------------------------------------
def run_vllm(loaded, setup: LongSetup, scenario: str, prompts: list[LongPrompt], log_dir: Path) -> LongRow:
    """vLLM's CPU build with a KV space of the device budget and the model's whole context: it is
    expected to refuse at start; its message, verbatim. Should it start, the prompts are sent."""
    from kvtier import models
    from kvtier.evals.passkey import is_correct
    from kvtier.bench.servers import BLOCK_TOKENS, VllmServer

    # The budget is set in blocks: on the CPU platform VLLM_CPU_KVCACHE_SPACE (GiB, which the launcher
    # sets) overrides --kv-cache-memory-bytes (vllm/platforms/cpu.py); the blocks override applies after.
    num_blocks = setup.device_tokens // BLOCK_TOKENS
    budget = num_blocks * BLOCK_TOKENS * loaded.kv_layout(setup.block_tokens).bytes_per_token
    row = LongRow("vllm", scenario, budget_bytes=budget, device_kv_bytes=budget)
    context = int(loaded.model.config.max_position_embeddings)
    server = VllmServer(models.cache_dir() / "smollm2-135m-instruct", log_dir / f"vllm-{scenario}.log",
                        extra_args=("--num-gpu-blocks-override", str(num_blocks)), max_model_len=context)
    start = time.perf_counter()
    try:
        with server:
            row.message = f"started ({num_blocks} blocks of {BLOCK_TOKENS} tokens, --max-model-len {context})"
            for prompt in prompts:
                t0 = time.perf_counter()
                try:
                    reply = server.complete(prompt.token_ids, max_tokens=setup.max_tokens)
                    row.requests.append(RequestResult(len(prompt.token_ids), reply["token_ids"] or [], prompt.passkey,
                                                      reply["text"], is_correct(reply["text"], prompt.passkey),
                                                      time.perf_counter() - t0, "length"))
                except RuntimeError as exc:
                    row.requests.append(RequestResult(len(prompt.token_ids), [], prompt.passkey, "", False, math.nan,
                                                      "error", str(exc)[:500]))
    except RuntimeError as exc:  # the reason is in the log, above the traceback's tail the exception carries
        log_text = server.log_path.read_text(errors="replace") if server.log_path.exists() else ""
        row.message = refusal_message(log_text or str(exc))
    row.wall_s = time.perf_counter() - start
    return row


def refusal_message(log_text: str) -> str:
    """The line of a vLLM start log that says why it stopped (its ValueError), verbatim."""
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    for marker in ("KV cache is needed", "ValueError:", "Error:"):
        found = [line for line in lines if marker in line]
        if found:
            line = found[-1]
            return line[line.index("ValueError:"):] if "ValueError:" in line else line
    return lines[-1] if lines else "vLLM exited without a message"


# -- the whole benchmark ------------------------------------------------------------------------------
def run(setup: LongSetup, *, progress: Callable[[str, int, int], None] = lambda *a: None,
        log: Callable[[str], None] = print, save: Path | None = None, log_dir: Path | None = None) -> list[LongRow]:
    from kvtier import models
    from kvtier.data import SHAKESPEARE, shared_data_file
    from kvtier.bench.servers import VLLM_PYTHON

    loaded = models.load(setup.model, device="cpu")
    tokenizer = loaded.tokenizer
    if tokenizer is None:  # byte-level tiny models
        def encode(s: str) -> list[int]: return list(s.encode())
        def decode(ids: list[int]) -> str: return bytes(i % 256 for i in ids).decode(errors="replace")
    else:
        def encode(s: str) -> list[int]: return tokenizer(s, add_special_tokens=False).input_ids
        def decode(ids: list[int]) -> str: return tokenizer.decode(ids)
    text = shared_data_file(SHAKESPEARE).read_text()
    names = setup.system_names()
    if "vllm" in names and (setup.model != "smollm2" or not VLLM_PYTHON.exists()):
        log(f"vllm skipped: {VLLM_PYTHON} not found (`make vllm` creates it, or set KVTIER_VLLM_PYTHON)"
            if setup.model == "smollm2" else "vllm skipped: it serves SmolLM2 only here")
        names.remove("vllm")
    rows: list[LongRow] = []
    context = int(loaded.model.config.max_position_embeddings)
    for scenario in setup.scenarios:
        lengths = setup.prompt_lengths(scenario)
        if max(lengths) + setup.max_tokens > context:  # "an 8k request": prompt + generated within the context
            log(f"{scenario}: {max(lengths)}-token prompts + {setup.max_tokens} generated exceed the {context}-token "
                f"context: prompts of {context - setup.max_tokens} tokens")
            lengths = [min(n, context - setup.max_tokens) for n in lengths]
        prompts = make_prompts(encode, text, lengths, setup.seed)
        for name in names:
            log(f"{name} / {scenario}: {len(prompts)} x {len(prompts[0].token_ids)} prompt tokens, "
                f"{setup.max_tokens} generated each")
            if name == "vllm":
                if scenario != setup.scenarios[0]:
                    continue  # its refusal is at start, the same for every scenario
                import tempfile
                row = run_vllm(loaded, setup, scenario, prompts, log_dir or Path(tempfile.mkdtemp(prefix="bench-long-")))
            else:
                try:
                    row = run_engine(loaded, setup, name, scenario, prompts, decode, progress)
                except Exception as exc:  # noqa: BLE001 - a system that fails is a row that says so
                    row = LongRow(name, scenario, message=f"failed: {type(exc).__name__}: {exc}")
            rows.append(row)
            compare_to_reference(rows)
            log(summary_line(row))
            if save is not None:
                save.write_text(json.dumps([r.to_dict() for r in rows], indent=1))
    return rows


def summary_line(row: LongRow) -> str:
    if not row.requests:
        return f"{row.system} / {row.scenario}: {row.message}"
    return (f"{row.system} / {row.scenario}: {row.completed}/{len(row.requests)} completed, TTFT {row.ttft_s:.1f} s, "
            f"decode {row.decode_tokens_per_s:.2f} tok/s, {row.fetched_bytes_per_token / 1e6:.1f} MB/token fetched, "
            f"passkey {row.passkey_accuracy:.0%}, agreement {row.agreement}, wall {row.wall_s:.0f} s")


# -- targets and tables ------------------------------------------------------------------------------
@dataclass(slots=True)
class Target:
    name: str
    value: str
    goal: str
    met: bool | None   # None: not measured in this run


def _find(rows: list[LongRow], system: str, scenario: str) -> LongRow | None:
    return next((r for r in rows if r.system == system and r.scenario == scenario and r.requests), None)


def _sparse_name(rows: list[LongRow], fraction: Fraction) -> str | None:
    for row in rows:
        if row.system.startswith("sparse:") and Fraction(row.system[7:]).limit_denominator(1024) == fraction:
            return row.system
    return None


def targets(rows: list[LongRow]) -> list[Target]:
    """Issue 18's targets, evaluated on the rows (`met` None where this run did not measure it)."""
    out = []
    offloaded = [r for r in rows if r.within_budget is not None and r.requests]
    worst = max((max(r.device_kv_bytes, r.peak_device_kv_used_bytes, r.request_peak_device_kv_bytes) / r.budget_bytes
                 for r in offloaded), default=math.nan)
    out.append(Target("peak device KV <= budget (exact, sparse)",
                      "-" if math.isnan(worst) else f"{worst:.0%} of the budget at most", "<= 100%",
                      all(r.within_budget for r in offloaded) if offloaded else None))
    exact_rows = [r for r in rows if r.system == "exact" and r.identical is not None]
    out.append(Target("exact token-identical to the reference",
                      ", ".join(f"{r.scenario}: {'yes' if r.identical else 'NO'}" for r in exact_rows) or "-",
                      "identical", all(r.identical for r in exact_rows) if exact_rows else None))
    ref, exact = _find(rows, "reference", "long"), _find(rows, "exact", "long")
    ratio = exact.decode_tokens_per_s / ref.decode_tokens_per_s if ref and exact else math.nan
    out.append(Target("exact decode tok/s vs reference (long)", "-" if math.isnan(ratio) else f"{ratio:.0%}", ">= 50%",
                      ratio >= 0.5 if not math.isnan(ratio) else None))
    alone = exact.fetch_alone_gb_s / exact.memcpy_gb_s if exact and exact.fetch_alone_gb_s and exact.memcpy_gb_s \
        else math.nan
    out.append(Target("exact fetch (the engine's gathers, alone) vs warm memcpy of the same bytes (long)",
                      "-" if math.isnan(alone) else f"{alone:.0%}", ">= 80%", alone >= 0.8 if not math.isnan(alone) else None))
    copy = exact.copy_gb_s / exact.memcpy_gb_s if exact and exact.memcpy_gb_s else math.nan
    out.append(Target("exact fetch in the step (beside the forward, on the same cores) vs warm memcpy (long)",
                      "-" if math.isnan(copy) else f"{copy:.0%}", ">= 80%", copy >= 0.8 if not math.isnan(copy) else None))
    name = _sparse_name(rows, Fraction(1, 8))
    for scenario in SCENARIOS:
        sparse, ex = (_find(rows, name, scenario) if name else None), _find(rows, "exact", scenario)
        share = sparse.fetched_bytes_per_token / ex.fetched_bytes_per_token if sparse and ex and \
            ex.fetched_bytes_per_token else math.nan
        out.append(Target(f"sparse 1/8 bytes per decode token vs exact ({scenario})",
                          "-" if math.isnan(share) else f"{share:.2%}", "<= 12.5%",
                          share <= 0.125 + 1e-9 if not math.isnan(share) else None))
    repeat = _find(rows, "exact", "repeat")
    if repeat is not None:
        q = repeat.requests[0]
        # every full block before the last token, but the blocks its recent window would hold at the end
        # (the host room reserved for a request is its end state's: the last of them are recomputed)
        full = (q.prompt_tokens - 1) // repeat.block_tokens * repeat.block_tokens if repeat.block_tokens else -1
        want = full - max(repeat.recent_blocks - 1, 0) * repeat.block_tokens
        out.append(Target("exact repeat: the second request reuses the offloaded prefix, same tokens",
                          f"{q.cached_tokens:,} of {q.prompt_tokens:,} prompt tokens cached, TTFT {repeat.first_ttft_s:.1f} s "
                          f"-> {repeat.ttft_s:.2f} s ({repeat.first_ttft_s / repeat.ttft_s:.0f}x); identical: "
                          f"{'yes' if repeat.identical else 'NO' if repeat.identical is not None else '-'}",
                          "every full block before the last token but the recent window's; identical",
                          bool(q.cached_tokens) and q.cached_tokens >= want and repeat.identical is not False))
    concurrent = [r for r in rows if r.scenario == "concurrent" and r.system.startswith(("exact", "sparse"))
                  and r.requests]
    out.append(Target("every concurrent request completes on the budget",
                      ", ".join(f"{r.system} {r.completed}/{len(r.requests)}" for r in concurrent) or "-",
                      "all", all(r.completed == len(r.requests) for r in concurrent) if concurrent else None))
    return out


def _mb(num_bytes: float) -> str:
    if num_bytes >= 1e6:
        return f"{num_bytes / 1e6:,.1f} MB"
    return f"{num_bytes / 1e3:,.1f} kB" if num_bytes >= 1e3 else f"{num_bytes:.0f} B"


def _gb_s(value: float) -> str:
    return "-" if math.isnan(value) or not value else f"{value:.2f}"


def render(rows: list[LongRow]) -> str:
    """Markdown: the table, the targets, vLLM's message."""
    lines = ["| scenario | system | completed | TTFT (mean) | decode tok/s | device KV allocated | device KV used at "
             "peak | request window peak | host→device per decode token | copy GB/s (in the step) | fetch alone GB/s | strided copy GB/s | "
             "memcpy GB/s | agreement with reference | passkey |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.requests:
            said = "refused at start (its message below)" if r.system == "vllm" and "Error" in r.message else r.message
            lines.append(f"| {r.scenario} | {r.system} | {said} |" + " |" * 12)
            continue
        agree = ("(reference)" if r.system == "reference" else
                 ", ".join(f"{a:.0%}" for a in r.agreement) if r.agreement else "-")
        offloaded = r.system.startswith(("exact", "sparse"))
        lines.append(
            f"| {r.scenario} | {r.system} | {r.completed}/{len(r.requests)} | {r.ttft_s:,.1f} s | "
            f"{r.decode_tokens_per_s:.2f} | {_mb(r.device_kv_bytes)} | {_mb(r.peak_device_kv_used_bytes)} | "
            f"{_mb(r.request_peak_device_kv_bytes) if offloaded else '-'} | "
            f"{_mb(r.fetched_bytes_per_token) if offloaded else '0'} | "
            f"{_gb_s(r.copy_gb_s)} | {_gb_s(r.fetch_alone_gb_s)} | {_gb_s(r.strided_copy_gb_s)} | {_gb_s(r.memcpy_gb_s)} | {agree} | "
            f"{sum(q.correct for q in r.requests)}/{len(r.requests)} |")
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    for t in targets(rows):
        lines.append(f"| {t.name} | {t.value} | {t.goal} | {({None: 'not measured', True: 'met', False: 'NOT met'})[t.met]} |")
    for r in rows:
        if r.system == "vllm":
            lines += ["", f"vLLM ({r.scenario}): {r.message}"]
    return "\n".join(lines)


def plot(rows: list[LongRow], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    panels = [("decode tokens/s", lambda r: r.decode_tokens_per_s, False),
              ("TTFT (s)", lambda r: r.ttft_s, False),
              ("host→device MB per decode token", lambda r: r.fetched_bytes_per_token / 1e6, True),
              ("passkey accuracy / agreement", None, False)]
    scenarios = [s for s in ALL_SCENARIOS if any(r.scenario == s and r.requests for r in rows)]
    systems = list(dict.fromkeys(r.system for r in rows if r.requests))
    x = np.arange(len(systems))
    width = 0.8 / max(len(scenarios), 1)
    for ax, (label, value, log_scale) in zip(axes, panels):
        for j, scenario in enumerate(scenarios):
            found = {r.system: r for r in rows if r.scenario == scenario and r.requests}
            if value is None:
                ys = [found[s].passkey_accuracy if s in found else 0 for s in systems]
                ys2 = [statistics.mean(found[s].agreement) if s in found and found[s].agreement else 0 for s in systems]
                ax.bar(x + j * width - 0.4 + width / 2, ys, width / 2, label=f"passkey ({scenario})")
                ax.bar(x + j * width - 0.4 + width, ys2, width / 2, label=f"agreement ({scenario})")
                continue
            ys = [value(found[s]) if s in found else 0 for s in systems]
            ax.bar(x + j * width - 0.4 + width / 2, [0 if math.isnan(y) else y for y in ys], width, label=scenario)
        ax.set_xticks(x, systems, rotation=35, ha="right", fontsize=8)
        ax.set_title(label, fontsize=9)
        if log_scale:
            ax.set_yscale("symlog", linthresh=1)
        ax.legend(fontsize=7)
    refused = [r for r in rows if r.system == "vllm" and not r.requests]
    if refused:
        axes[0].text(0.02, 0.97, "vLLM at this budget: refused at start", transform=axes[0].transAxes, va="top",
                     fontsize=8, color="#a00")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_command(bench) -> None:
    """Register `kvtier bench long` on the `bench` typer group."""
    import typer

    @bench.command("long")
    def long(long_tokens: int = typer.Option(8192, min=16), concurrent: int = typer.Option(4, min=1),
             concurrent_tokens: int = typer.Option(6144, min=16), max_tokens: int = typer.Option(32, min=2),
             budgets: str = typer.Option(",".join(DEFAULT_BUDGETS), help="sparse budgets: fractions or blocks"),
             systems: str = typer.Option(",".join(SYSTEMS), help=", ".join(SYSTEMS)),
             scenarios: str = typer.Option(",".join(SCENARIOS), help="long (one request), concurrent, repeat (the "
                                           "long request again after it: its prefix reused)"),
             device_tokens: int = typer.Option(1024, min=1, help="the device KV budget in tokens (fetch area in it)"),
             block_tokens: int = typer.Option(64, min=1),
             fetch_blocks: int = typer.Option(15, min=1, help="layer-blocks per half of the fetch area"),
             sink_blocks: int = typer.Option(1, min=0), recent_blocks: int = typer.Option(2, min=1),
             model: str = typer.Option("smollm2", help="smollm2 or tiny (tests)"),
             as_json: bool = typer.Option(False, "--json", help="the rows as JSON on stdout"),
             save: Path = typer.Option(None, help="write the rows as JSON here after each system"),
             plot_path: Path = typer.Option(None, "--plot", help="write a PNG"),
             log_dir: Path = typer.Option(None, help="where vLLM's log goes (default: a temp dir)"),
             from_json: list[Path] = typer.Option(None, help="render saved rows (--save files, in order; a later "
                                                           "file's row replaces an earlier one of the same system "
                                                           "and scenario) instead of running")) -> None:
        """Contexts larger than the device: one long request, then concurrent ones, on a small device
        KV budget — vLLM, kvtier exact and sparse offload, and everything on the device."""
        import os

        from rich.console import Console

        from kvtier.config import parse_offload
        from kvtier.errors import UserError

        names = tuple(s.strip() for s in systems.split(",") if s.strip())
        chosen = tuple(s.strip() for s in scenarios.split(",") if s.strip())
        budget_list = tuple(b.strip() for b in budgets.split(",") if b.strip())
        if set(names) - set(SYSTEMS) or set(chosen) - set(ALL_SCENARIOS) or not names or not chosen:
            raise UserError(f"systems are {', '.join(SYSTEMS)}; scenarios {', '.join(ALL_SCENARIOS)}")
        for b in budget_list:
            try:
                parse_offload(f"sparse:{b}")
            except ValueError as exc:
                raise UserError(str(exc)) from None
        setup = LongSetup(long_tokens, concurrent, concurrent_tokens, max_tokens, budget_list, device_tokens,
                          block_tokens, sink_blocks, recent_blocks, fetch_blocks, systems=names, scenarios=chosen,
                          model=model)
        console = Console(stderr=True)
        if from_json:
            rows = merge_rows([[LongRow.from_dict(d) for d in json.loads(p.read_text())] for p in from_json])
            compare_to_reference(rows)
        else:
            rows = _run_with_progress(setup, console, save, log_dir)
        title = (f"kvtier bench long: SmolLM2 fp32 KV, device budget {device_tokens} tokens ({block_tokens}-token "
                 f"blocks), {long_tokens}-token request, {concurrent} x {concurrent_tokens}; {os.cpu_count()} CPUs"
                 + ("" if from_json else f", load average {os.getloadavg()[0]:.1f}"))
        if plot_path:
            plot(rows, plot_path, title)
            console.log(f"plot written to {plot_path}")
        if as_json:
            print(json.dumps([r.to_dict() for r in rows], indent=1))
        else:
            print(render(rows))
        sys.stdout.flush()


def merge_rows(files: list[list[LongRow]]) -> list[LongRow]:
    """Rows of several runs: a later run's row replaces the same (system, scenario) of an earlier one."""
    merged: dict[tuple[str, str], LongRow] = {}
    for rows in files:
        for row in rows:
            merged[(row.system, row.scenario)] = row
    return sorted(merged.values(), key=_row_order)


def _row_order(row: LongRow) -> tuple:
    """Scenario, then vllm, reference, exact, sparse by budget."""
    kind = row.system.partition(":")[0]
    budget = float(Fraction(row.system[7:])) if kind == "sparse" else 0.0
    rank = {"vllm": 0, "reference": 1, "exact": 2}.get(kind, 3)
    return (SCENARIOS.index(row.scenario) if row.scenario in SCENARIOS else 9, rank, budget)


def _run_with_progress(setup: LongSetup, console, save: Path | None, log_dir: Path | None) -> list[LongRow]:
    """`run`, its progress as bars on a terminal, as a line per tenth of each system's tokens in a log."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} "
                  "tokens"), TimeElapsedColumn(), console=console, disable=not console.is_terminal) as bar:
        tasks: dict[str, int] = {}
        last_logged: dict[str, int] = {}

        def progress(label: str, done: int, total: int) -> None:
            if label not in tasks:
                tasks[label] = bar.add_task(label, total=total)
            bar.update(tasks[label], completed=done)
            if not console.is_terminal and done - last_logged.get(label, -total) >= max(total // 10, 1):
                last_logged[label] = done
                console.log(f"{label}: {done:,}/{total:,} tokens computed")

        return run(setup, progress=progress, log=console.log, save=save, log_dir=log_dir)
