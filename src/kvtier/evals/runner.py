"""The `kvtier eval` grid: every method on the same perplexity windows and passkey prompts.

Each window / prompt is prefilled once in full precision (`prefill`); `fill` then writes that KV
into each method's cache exactly as a prefill through the cache would have (quantizing it, or
scoring and evicting it with the recorded query states), so the shared prefill costs one forward
pass for the whole grid. The continuation (scored chunks, or cue + greedy answer) runs through each
method's own cache. See `perplexity` and `passkey` for the two protocols.

Sparse offload (`sparse:1/8`, issue 18) keeps every token (the engine holds the middle blocks in host
memory) and attends at each decode step to the sinks, the recent window and the top pages by their
summaries' score (`evals/sparse.py`, the engine's own functions): its continuation is scored one token per step,
as the engine decodes it (teacher forcing), and its passkey answer is greedy-decoded the same way.

Sizes are those of a 16-bit (bf16/fp16) KV cache, the way models are served: full-precision
tensors count 2 bytes per element whatever dtype the CPU run computes in; quantized payloads and
their scales count what they store.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import torch
from transformers import DynamicCache, QuantizedCache
from transformers.cache_utils import Cache

from kvtier.codecs.quant import DEFAULT_GROUP_TOKENS
from kvtier.config import PAGE_SUMMARY_VECTORS
from kvtier.offload.config import OffloadMode, parse_offload
from kvtier.errors import UserError
from kvtier.evals import passkey as pk
from kvtier.evals import sparse
from kvtier.evals.perplexity import NLL, prefill_tokens, score_continuation, text_windows
from kvtier.levers import eviction
from kvtier.levers.eviction import EvictionCache, EvictionPolicy

SERVED_BYTES_PER_ELEMENT = 2
QUANT_METHODS = ("fp8", "int8", "int4", "int2")
# KIVI int4 with 128-token key groups (one group per residual window): 0.547 bytes per element for the
# blocks (vs 0.5625 with 64-token groups) — the layout that reaches 3.5x at SmolLM2's full 8k context
WIDE_GROUP_METHODS = {"int4-g128": ("int4", 128)}
# method -> (codec, key group tokens) of kvtier's QuantizedKVCache
_QUANT_LAYOUTS = {**{name: (name, DEFAULT_GROUP_TOKENS) for name in QUANT_METHODS}, **WIDE_GROUP_METHODS}
EVICTION_METHODS = eviction.POLICIES
PEER_METHODS = ("hf-quanto-int4", "hf-quanto-int2", "hf-hqq-int4", "hf-hqq-int2", "hf-fp8")
OFFLOAD_METHODS = ("sparse",)  # `sparse` (each of --offload-budgets) or `sparse:1/8`
ALL_METHODS = ("raw", *QUANT_METHODS, *WIDE_GROUP_METHODS, *EVICTION_METHODS, *PEER_METHODS, *OFFLOAD_METHODS)
DEFAULT_METHODS = ("raw", *QUANT_METHODS, *EVICTION_METHODS, "hf-quanto-int4", "hf-quanto-int2", "hf-hqq-int4",
                   "hf-hqq-int2")
SNAPKV_WINDOW_TOKENS = eviction.DEFAULT_SNAPKV_WINDOW_TOKENS
HF_GROUP_TOKENS = 64
HF_RESIDUAL_TOKENS = 128


@dataclass(slots=True)
class Method:
    name: str
    keep: float | None = None
    window_tokens: int = SNAPKV_WINDOW_TOKENS   # SnapKV's observation window
    question_window: bool = False  # SnapKV: the window is the prompt's question where there is one
    offload: OffloadMode | None = None  # sparse offload: the fetch budget
    # sparse offload: the engine's layout (its defaults: sparse.DEFAULT_*) — block size, sinks and recent
    # window on the device, the pages selected (at most a block)
    block_tokens: int = sparse.DEFAULT_BLOCK_TOKENS
    sink_blocks: int = sparse.DEFAULT_SINK_BLOCKS
    recent_blocks: int = sparse.DEFAULT_RECENT_BLOCKS
    page_tokens: int = sparse.DEFAULT_PAGE_TOKENS

    @property
    def label(self) -> str:
        if self.offload is not None:  # sparse-1/8, or sparse-1/8-b64-s0-p16-r8 off the engine's default layout
            page_tokens = self.sparse_window.page_tokens  # (an effective page other than the default's)
            return (str(self.offload).replace(":", "-")
                    + (f"-b{self.block_tokens}" if self.block_tokens != sparse.DEFAULT_BLOCK_TOKENS else "")
                    + (f"-s{self.sink_blocks}" if self.sink_blocks != sparse.DEFAULT_SINK_BLOCKS else "")
                    + (f"-p{page_tokens}" if page_tokens != min(sparse.DEFAULT_PAGE_TOKENS, self.block_tokens) else "")
                    + (f"-r{self.recent_blocks}" if self.recent_blocks != sparse.DEFAULT_RECENT_BLOCKS else ""))
        name = self.name
        if name == "snapkv" and self.question_window:
            name = "snapkv-q"
        elif name == "snapkv" and self.window_tokens != SNAPKV_WINDOW_TOKENS:
            name = f"snapkv-w{self.window_tokens}"
        return name if self.keep is None else f"{name}@{self.keep:g}"

    @property
    def sparse_window(self) -> sparse.SparseWindow | None:
        if self.offload is None:
            return None
        return sparse.SparseWindow(self.offload, self.block_tokens, self.sink_blocks, self.recent_blocks,
                                   self.page_tokens)

    def model_for(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model the continuation runs through: a sparse method's attends as the engine's sparse offload."""
        window = self.sparse_window
        return model if window is None else sparse.sparse_model(model, window)

    def new_cache(self, model: torch.nn.Module, question_tokens: int = 0) -> Cache:
        """A fresh cache; `question_tokens`: the length of the prompt's closing question (0: none)."""
        if self.name in ("raw", "sparse"):  # sparse: every token kept, the model selects at decode steps
            return DynamicCache(config=model.config)
        if self.name in _QUANT_LAYOUTS:
            from kvtier.codecs.quant import quantizer
            from kvtier.levers.quantized_cache import QuantizedKVCache

            codec, group_tokens = _QUANT_LAYOUTS[self.name]
            return QuantizedKVCache(model.config, codec, quantizer=quantizer(codec, group_tokens=group_tokens))
        if self.name in EVICTION_METHODS:
            window = question_tokens if self.question_window and question_tokens else self.window_tokens
            return EvictionCache.for_model(model, EvictionPolicy(self.name, keep=self.keep, window_tokens=window))
        if self.name == "hf-fp8":
            return QuantizedCache("fp8", model.config)
        backend, bits = self.name.removeprefix("hf-").split("-int")
        # axis 0 (transformers' default) for both backends: HQQ's 2-bit packing fails on axis 1 here
        return QuantizedCache(backend, model.config, nbits=int(bits), axis_key=0, axis_value=0,
                              q_group_size=HF_GROUP_TOKENS, residual_length=HF_RESIDUAL_TOKENS)


def parse_methods(methods: str, keeps: str, snapkv_window_tokens: int | str = SNAPKV_WINDOW_TOKENS,
                  offload_budgets: str = sparse.DEFAULT_BUDGETS,
                  block_tokens: int = sparse.DEFAULT_BLOCK_TOKENS, sink_blocks: int = sparse.DEFAULT_SINK_BLOCKS,
                  recent_blocks: int = sparse.DEFAULT_RECENT_BLOCKS,
                  page_tokens: int = sparse.DEFAULT_PAGE_TOKENS) -> list[Method]:
    """`raw,int4,h2o` + `0.25,0.5` -> raw, int4, h2o@0.25, h2o@0.5 (raw is always included, first).
    `snapkv_window_tokens`: a token count, or "question" (the passkey question; 32 where there is none).
    `sparse` -> one sparse offload method per `offload_budgets`; `sparse:1/8` -> that budget only, each on
    the layout `block_tokens` / `sink_blocks` / `recent_blocks` / `page_tokens` (the engine's defaults)."""
    question = snapkv_window_tokens == "question"
    window = SNAPKV_WINDOW_TOKENS if question else snapkv_window_tokens
    names = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in ALL_METHODS and not m.startswith("sparse:")]
    if unknown:
        raise UserError(f"unknown method(s) {', '.join(unknown)}: use {', '.join(ALL_METHODS)}")
    keep_values = parse_floats(keeps, "--keep")
    if any(not 0.0 < k <= 1.0 for k in keep_values):
        raise UserError("--keep values must be fractions in (0, 1]")
    out = [Method("raw")]
    for name in names:
        if name in EVICTION_METHODS:
            out += [Method(name, k, window, question) for k in keep_values]
        elif name == "sparse" or name.startswith("sparse:"):
            budgets = [b.strip() for b in offload_budgets.split(",") if b.strip()] if name == "sparse" \
                else [name.partition(":")[2]]
            out += [Method("sparse", offload=_sparse_mode(b), block_tokens=block_tokens, sink_blocks=sink_blocks,
                           recent_blocks=recent_blocks, page_tokens=page_tokens) for b in budgets]
        elif name != "raw":
            out.append(Method(name))
    return out


def _sparse_mode(budget: str) -> OffloadMode:
    try:
        return parse_offload(f"sparse:{budget}")
    except ValueError as exc:
        raise UserError(str(exc)) from None


def parse_floats(text: str, option: str) -> list[float]:
    """Comma-separated numbers or fractions (`0.125` or `1/8`)."""
    try:
        return [float(Fraction(x.strip())) for x in text.split(",") if x.strip()]
    except (ValueError, ZeroDivisionError):
        raise UserError(f"{option} takes comma-separated numbers, got {text!r}") from None


def parse_ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option} takes comma-separated integers, got {text!r}") from None
    if any(v < 16 for v in values):
        raise UserError(f"{option} values must be at least 16 tokens")
    return values


# -- the shared prefill ------------------------------------------------------------------------

@dataclass(slots=True)
class Prefill:
    """One full-precision prefill: per-layer KV [B, Hkv, n, D] and post-RoPE queries [B, Hq, n, D]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor] | None
    scaling: float
    scores: dict[tuple, list[torch.Tensor | None]] = field(default_factory=dict)

    def policy_scores(self, policy: EvictionPolicy) -> list[torch.Tensor | None]:
        """Each layer's prefill scores for `policy` (they do not depend on the budget: computed once)."""
        if not policy.needs_queries:  # StreamingLLM (the prefill may not have recorded queries)
            return [None] * len(self.keys)
        key = (policy.name, policy.window_tokens, policy.kernel_tokens)  # what the scores depend on
        if key not in self.scores:
            self.scores[key] = [eviction.policy_scores(policy, q, k, self.scaling)
                                for q, k in zip(self.queries, self.keys)]
        return self.scores[key]


@torch.inference_mode()
def prefill(model: torch.nn.Module, token_ids: torch.Tensor, *, record_queries: bool) -> Prefill:
    cache = DynamicCache(config=model.config)
    modules = eviction.attention_modules(model)
    queries: list[torch.Tensor | None] = [None] * len(modules)

    def record(module, args, kwargs, output):
        queries[module.layer_idx] = eviction.query_states(module, kwargs["hidden_states"],
                                                          kwargs["position_embeddings"])

    handles = [m.register_forward_hook(record, with_kwargs=True) for m in modules] if record_queries else []
    try:
        model(token_ids, past_key_values=cache, use_cache=True)
    finally:
        for handle in handles:
            handle.remove()
    return Prefill([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers],
                   queries if record_queries else None, modules[0].scaling)


@torch.inference_mode()
def fill(cache: Cache, pre: Prefill) -> None:
    """Write the prefill into `cache` as a forward pass through it would (then evict, if it evicts)."""
    for idx, (k, v) in enumerate(zip(pre.keys, pre.values)):
        cache.update(k, v, idx)
    if isinstance(cache, EvictionCache):
        for layer, scores in zip(cache.layers, pre.policy_scores(cache.policy)):
            layer.apply_scores(scores)


# -- sizes -------------------------------------------------------------------------------------

def full_precision_bytes_per_token(config) -> int:
    from kvtier.models import head_dim, num_kv_heads

    return 2 * config.num_hidden_layers * num_kv_heads(config) * head_dim(config) * SERVED_BYTES_PER_ELEMENT


def kv_bytes(cache: Cache, config) -> int:
    """Resident KV bytes of `cache`, full-precision parts counted at 16 bits."""
    if hasattr(cache, "nbytes"):  # kvtier's QuantizedKVCache: exact payload + scale bytes
        return cache.nbytes(SERVED_BYTES_PER_ELEMENT)
    if isinstance(cache, QuantizedCache):
        elements_per_token = full_precision_bytes_per_token(config) // SERVED_BYTES_PER_ELEMENT \
            // config.num_hidden_layers
        return sum(_hf_quantized_layer_bytes(layer, elements_per_token) for layer in cache.layers)
    return sum((layer.keys.numel() + layer.values.numel()) * SERVED_BYTES_PER_ELEMENT
               for layer in cache.layers if layer.is_initialized)


def _hf_quantized_layer_bytes(layer, elements_per_token: int) -> int:
    """transformers' quantized layers (batch 1). quanto / HQQ: `nbits` per element + a 16-bit scale
    and zero point per group (HQQ packs bits; quanto's CPU path keeps one uint8 per element, packed
    storage being what a GPU deployment holds) + the 16-bit residual. fp8: 1 byte per element."""
    if not layer.is_initialized:
        return 0
    if not hasattr(layer, "nbits"):  # Fp8QuantizedLayer: per-tensor scales, no residual
        return layer._quantized_keys[0].numel() + layer._quantized_values[0].numel() + 2 * 4
    residual_tokens = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
    quantized_tokens = layer.cumulative_length - residual_tokens
    per_element = layer.nbits / 8 + 2 * SERVED_BYTES_PER_ELEMENT / layer.q_group_size
    return math.ceil(quantized_tokens * elements_per_token * per_element) \
        + residual_tokens * elements_per_token * SERVED_BYTES_PER_ELEMENT


# -- the grid ----------------------------------------------------------------------------------

@dataclass(slots=True)
class EvalConfig:
    methods: list[Method]
    context_tokens: list[int] = field(default_factory=lambda: [2048])
    num_windows: int = 2
    chunk_tokens: int = 128
    score_tokens: int | None = None  # perplexity: the last tokens of each window scored (None: its second half)
    passkey_lengths: list[int] = field(default_factory=lambda: [1024, 2048])
    passkey_depths: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    answer_tokens: int = 8
    seed: int = 0


@dataclass(slots=True)
class EvalRow:
    method: str
    keep: float | None
    label: str
    bits_or_budget: str
    bytes_per_token: float | None = None
    compression: float | None = None
    ppl: float | None = None
    delta_ppl_pct: float | None = None
    passkey_acc: float | None = None
    ppl_by_context: dict[str, float] = field(default_factory=dict)
    passkey_acc_by_length: dict[str, float] = field(default_factory=dict)
    # where the KV is while decoding (16-bit): on the device (sparse offload: sinks + recent window + the block
    # summaries), fetched from host memory per decode token, and the share of the context each step attends to
    device_kv_bytes: float | None = None
    fetched_bytes_per_token: float | None = None
    attended_fraction: float | None = None
    error: str | None = None


@dataclass(slots=True)
class _Tally:
    nll_by_context: dict[int, NLL] = field(default_factory=dict)
    bytes_per_token: list[float] = field(default_factory=list)          # at the end of each ppl window
    passkey_bytes_per_token: list[float] = field(default_factory=list)  # after each answer (passkey-only runs)
    correct_by_length: dict[int, list[bool]] = field(default_factory=dict)
    device_kv_bytes: list[float] = field(default_factory=list)          # after each window / answer
    fetched_bytes_per_token: list[float] = field(default_factory=list)
    attended_fraction: list[float] = field(default_factory=list)
    error: str | None = None


Progress = Callable[[str], None]


def run_eval(loaded, config: EvalConfig, token_ids: torch.Tensor | None, progress: Progress | None = None) -> list[EvalRow]:
    """Run the grid. token_ids [N]: the perplexity text (None: skip perplexity)."""
    model = loaded.model
    tallies = {m.label: _Tally() for m in config.methods}
    record = any(m.name in ("h2o", "snapkv") for m in config.methods)
    progress = progress or (lambda _: None)
    if token_ids is not None:
        for ctx in config.context_tokens:
            for w, window in enumerate(text_windows(token_ids, ctx, config.num_windows)):
                progress(f"perplexity ctx={ctx} window {w + 1}/{config.num_windows}")
                _perplexity_window(model, window.to(model.device), config, tallies, record, ctx)
    if config.passkey_lengths and loaded.tokenizer is not None:
        prompts = pk.make_prompts(loaded.tokenizer, config.passkey_lengths, config.passkey_depths, config.seed)
        for i, prompt in enumerate(prompts):
            progress(f"passkey {i + 1}/{len(prompts)} ({prompt.num_tokens} tokens, depth {prompt.depth:.0%})")
            _passkey_prompt(loaded, prompt, config, tallies, record)
    return _rows(config, tallies, full_precision_bytes_per_token(model.config))


def _guarded(tally: _Tally, work: Callable[[], None]) -> None:
    if tally.error is not None:
        return
    try:
        work()
    except Exception as exc:  # a peer backend that fails: reported in its row, the grid goes on
        tally.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _perplexity_window(model, window, config: EvalConfig, tallies, record: bool, ctx: int) -> None:
    num_prefill = ctx - config.score_tokens if config.score_tokens else prefill_tokens(ctx)
    pre = prefill(model, window[:, :num_prefill], record_queries=record)
    for method in config.methods:
        tally = tallies[method.label]

        def work(method=method, tally=tally):
            cache = method.new_cache(model)
            fill(cache, pre)
            run_model = method.model_for(model)
            chunk = 1 if method.offload is not None else config.chunk_tokens  # the engine's decode steps
            nll = score_continuation(run_model, cache, window[:, num_prefill:], chunk)
            tally.nll_by_context.setdefault(ctx, NLL()).add(nll)
            tally.bytes_per_token.append(kv_bytes(cache, model.config) / cache.get_seq_length())
            _tally_placement(tally, method, run_model, cache)

        _guarded(tally, work)


def _passkey_prompt(loaded, prompt: pk.PasskeyPrompt, config: EvalConfig, tallies, record: bool) -> None:
    model = loaded.model
    pre = prefill(model, prompt.context_ids.to(model.device), record_queries=record)
    for method in config.methods:
        tally = tallies[method.label]

        def work(method=method, tally=tally):
            cache = method.new_cache(model, prompt.question_tokens)
            fill(cache, pre)
            run_model = method.model_for(model)
            answer = pk.greedy_answer(run_model, cache, prompt.cue_ids.to(model.device), config.answer_tokens)
            correct = pk.is_correct(loaded.tokenizer.decode(answer), prompt.passkey)
            tally.correct_by_length.setdefault(prompt.target_tokens, []).append(correct)
            tally.passkey_bytes_per_token.append(kv_bytes(cache, model.config) / cache.get_seq_length())
            _tally_placement(tally, method, run_model, cache)

        _guarded(tally, work)


def _tally_placement(tally: _Tally, method: Method, run_model: torch.nn.Module, cache: Cache) -> None:
    """Device KV bytes, bytes fetched per decode token and the attended share, after a window / answer."""
    from kvtier.models import head_dim, num_kv_heads

    config, num_tokens = run_model.config, cache.get_seq_length()
    window = method.sparse_window
    if window is None:  # everything the cache holds is on the device, attended to, nothing fetched
        resident = cache.num_resident_tokens if isinstance(cache, EvictionCache) else num_tokens
        tally.device_kv_bytes.append(kv_bytes(cache, config))
        tally.fetched_bytes_per_token.append(0.0)
        tally.attended_fraction.append(resident / num_tokens)
        return
    stats = config.kvtier_sparse.stats
    layer_head_page_bytes = 2 * window.page_tokens * head_dim(config) * SERVED_BYTES_PER_ELEMENT
    first, end = window.host_blocks(num_tokens)
    num_pages = (end - first) * (window.block_tokens // window.page_tokens)
    device_tokens = num_tokens - (end - first) * window.block_tokens
    # per layer, KV head and page: its keys' min, max and mean, head_dim values each
    summary_bytes = (num_pages * config.num_hidden_layers * num_kv_heads(config) * PAGE_SUMMARY_VECTORS
                     * head_dim(config) * SERVED_BYTES_PER_ELEMENT)
    tally.device_kv_bytes.append(device_tokens * full_precision_bytes_per_token(config) + summary_bytes)
    if stats.num_decode_steps:
        tally.fetched_bytes_per_token.append(stats.num_fetched_pages * layer_head_page_bytes / stats.num_decode_steps)
        tally.attended_fraction.append(stats.num_attended_tokens / stats.num_context_tokens)


def _rows(config: EvalConfig, tallies: dict[str, _Tally], raw_bytes_per_token: int) -> list[EvalRow]:
    reference = tallies["raw"]
    rows = []
    for method in config.methods:
        tally = tallies[method.label]
        row = EvalRow(method.name, method.keep, method.label, _bits_or_budget(method))
        row.error = tally.error
        if tally.error is None:
            _fill_row(row, tally, reference, raw_bytes_per_token)
        rows.append(row)
    return rows


def _fill_row(row: EvalRow, tally: _Tally, reference: _Tally, raw_bytes_per_token: int) -> None:
    sizes = tally.bytes_per_token or tally.passkey_bytes_per_token
    if sizes:
        row.bytes_per_token = round(sum(sizes) / len(sizes), 1)
        row.compression = round(raw_bytes_per_token / row.bytes_per_token, 3)
    if tally.nll_by_context:
        total = NLL()
        for ctx, nll in tally.nll_by_context.items():
            total.add(nll)
            row.ppl_by_context[str(ctx)] = round(nll.ppl, 4)
        ref = NLL()
        for nll in reference.nll_by_context.values():
            ref.add(nll)
        row.ppl = round(total.ppl, 4)
        row.delta_ppl_pct = round(100.0 * (total.ppl / ref.ppl - 1.0), 3)
    for name in ("device_kv_bytes", "fetched_bytes_per_token", "attended_fraction"):
        values = getattr(tally, name)
        if values:
            setattr(row, name, round(sum(values) / len(values), 4))
    if tally.correct_by_length:
        flat = [c for results in tally.correct_by_length.values() for c in results]
        row.passkey_acc = round(sum(flat) / len(flat), 4)
        row.passkey_acc_by_length = {str(n): round(sum(r) / len(r), 4) for n, r in tally.correct_by_length.items()}


def _bits_or_budget(method: Method) -> str:
    if method.keep is not None:
        return f"keep {100 * method.keep:g}%"
    if method.offload is not None:
        budget = str(method.offload).partition(":")[2]
        unit = " of host pages" if method.offload.budget < 1 else " host pages"
        return f"fetch {budget}{unit}"
    return {"raw": "16-bit", "fp8": "8-bit fp", "int8": "8-bit", "int4": "4-bit", "int2": "2-bit",
            "int4-g128": "4-bit, 128-token key groups",
            "hf-quanto-int4": "4-bit", "hf-quanto-int2": "2-bit", "hf-hqq-int4": "4-bit", "hf-hqq-int2": "2-bit",
            "hf-fp8": "8-bit fp"}[method.name]
