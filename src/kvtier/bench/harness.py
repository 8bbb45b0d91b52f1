"""The harness `kvtier bench serve` and `kvtier bench vllm` share: the workloads (multi-turn chat over
tinyshakespeare, the Mooncake trace scaled to a model), the per-request clock, the per-system result
and its row, and the report (markdown table, JSON, plot). The systems themselves live with each command.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

SYSTEM_PROMPT = "You are a helpful assistant who answers questions about the play you are given."


@dataclass(slots=True)
class Workload:
    num_users: int = 6
    num_turns: int = 3
    context_chars: int = 1200
    turn_chars: int = 160
    max_tokens: int = 24


@dataclass(slots=True)
class Turn:
    ttft_s: float
    itl_s: list[float]
    token_ids: list[int]
    start_s: float = 0.0  # submitted, in seconds since the system's run began (`SystemResult.t0`)

    def token_times_s(self) -> list[float]:
        """When each token arrived, in seconds since the run began."""
        times = [self.start_s + self.ttft_s]
        for gap in self.itl_s:
            times.append(times[-1] + gap)
        return times


@dataclass(slots=True)
class SystemResult:
    name: str
    wall_s: float
    turns: dict[tuple[int, int], Turn] = field(default_factory=dict)
    num_failed: int = 0
    first_error: str = ""
    prefix_hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    step_tier_io_s: float = 0.0     # the engine step thread's time in tier calls
    transfer_s: float = 0.0         # the transfer worker's time in tier loads and stores
    computed_tokens: int = 0        # tokens through the forward (recomputation included)
    moved_bytes: int = 0            # KV loaded from the tiers onto the device
    t0: float = field(default_factory=time.perf_counter)  # the run's start: turns' `start_s` count from it

    def fail(self, exc: BaseException) -> None:
        """Count a failed request; keep the first error's text."""
        self.num_failed += 1
        self.first_error = self.first_error or f"{type(exc).__name__}: {exc}"

    def row(self, reference: "SystemResult | None") -> dict:
        ttfts = sorted(t.ttft_s for t in self.turns.values())
        itls = sorted(x for t in self.turns.values() for x in t.itl_s)
        num_tokens = sum(len(t.token_ids) for t in self.turns.values())
        same = None if reference is None else len(self.turns) == len(reference.turns) and all(
            reference.turns.get(k) is not None and reference.turns[k].token_ids == t.token_ids
            for k, t in self.turns.items())
        return {"system": self.name, "requests": len(self.turns), "failed": self.num_failed,
                "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
                "itl_p50_s": _pct(itls, 50), "itl_mean_s": statistics.fmean(itls) if itls else 0.0,
                "tokens_per_s": num_tokens / self.wall_s, "wall_s": self.wall_s,
                "prompt_tokens": self.num_prompt_tokens,
                "cached_tokens_by_tier": dict(self.prefix_hit_tokens_by_tier),
                "preemptions": self.num_preemptions, "step_tier_io_s": self.step_tier_io_s,
                "transfer_s": self.transfer_s, "computed_tokens": self.computed_tokens,
                "moved_bytes": self.moved_bytes, "same_text_as_generate": same, "first_error": self.first_error,
                "timeline": self.timeline()}

    def timeline(self) -> list[dict]:
        """Per request, in submission order: submitted, first token and last token (seconds since the
        run began), and the gaps between tokens (a stall shows as a long one)."""
        out = []
        for (user, turn), t in sorted(self.turns.items(), key=lambda kv: kv[1].start_s):
            times = t.token_times_s()
            out.append({"user": user, "turn": turn, "start_s": round(t.start_s, 4),
                        "first_token_s": round(times[0], 4), "end_s": round(times[-1], 4),
                        "itl_s": [round(gap, 4) for gap in t.itl_s]})
        return out


class TurnClock:
    """One request's TTFT (submit to first token, queueing included) and the gaps after it: `tick()`
    at each token (or chunk) that arrives."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.ttft: float | None = None
        self.itl: list[float] = []

    def tick(self) -> None:
        now = time.perf_counter()
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last)
        self.last = now

    def turn(self, token_ids: list[int], t0: float | None = None) -> Turn:
        """The finished turn; `t0`: the run's start, so the turn knows when it was submitted."""
        return Turn(self.ttft or 0.0, self.itl, token_ids, 0.0 if t0 is None else self.start - t0)


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]


def conversations(text: str, w: Workload) -> list[tuple[str, list[str]]]:
    """(opening passage, user messages) per user; users start far apart in the text."""
    stride = max(len(text) // max(w.num_users, 1), w.context_chars + w.num_turns * w.turn_chars)
    out = []
    for u in range(w.num_users):
        start = (u * stride) % max(1, len(text) - w.context_chars - w.num_turns * w.turn_chars)
        passage = text[start:start + w.context_chars]
        pos = start + w.context_chars
        messages = [f"Continue this: {text[pos + i * w.turn_chars:pos + (i + 1) * w.turn_chars]}"
                    for i in range(w.num_turns)]
        out.append((passage, messages))
    return out


def chat_prompt(tokenizer, passage: str, user_messages: list[str], replies: list[str]) -> list[int]:
    """A user's conversation so far (the system prompt holds the passage) in the model's chat template."""
    messages = [{"role": "system", "content": f"{SYSTEM_PROMPT}\n\n{passage}"}]
    for i, user in enumerate(user_messages):
        messages.append({"role": "user", "content": user})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]


# -- the Mooncake trace, scaled to a model -------------------------------------------------------------

@dataclass(slots=True)
class TraceRequest:
    arrival_s: float
    token_ids: list[int]
    max_tokens: int


def trace_requests(path, *, num_requests: int = 32, block_tokens: int = 16, max_tokens: int = 8,
                   time_scale: float = 1.0, vocab_size: int = 49152, max_context: int = 8192,
                   start: int = 0) -> list[TraceRequest]:
    """`num_requests` of a Mooncake trace from request `start` on (arrivals relative to the first of
    them), scaled to a small model: each 512-token block
    (`hash_ids`) becomes `block_tokens` tokens — fixed per block id, so requests that share block ids
    share exactly those token prefixes, as in the trace — the partial last block in proportion,
    outputs capped at `max_tokens`, arrivals at `timestamp × time_scale`, prompts cut to the context."""
    import torch

    from kvtier.sim.trace import BLOCK_TOKENS, read_trace

    out = []
    selected = read_trace(path)[start:start + num_requests]
    t0_ms = selected[0].timestamp_ms if selected else 0.0
    for r in selected:
        ids: list[int] = []
        for i, block_id in enumerate(r.hash_ids):
            n = max(1, round(r.block_tokens(i) * block_tokens / BLOCK_TOKENS))
            g = torch.Generator().manual_seed(block_id)
            ids += torch.randint(0, vocab_size, (block_tokens,), generator=g)[:n].tolist()
        ids = ids[:max_context - max_tokens - 1] or [0]
        out.append(TraceRequest((r.timestamp_ms - t0_ms) / 1000 * time_scale, ids,
                                max(1, min(r.output_length, max_tokens))))
    return out


# -- the report ----------------------------------------------------------------------------------------

def print_rows(rows: list[dict], as_json: bool, table=None) -> None:
    """The rows as JSON, or as a markdown table (`table(rows)`, default `render`) with each system's
    first failure under it."""
    import json

    if as_json:
        print(json.dumps(rows))
        return
    print((table or render)(rows))
    for r in rows:
        if r["first_error"]:
            print(f"{r['system']}: first failure: {r['first_error']}")


def render(rows: list[dict]) -> str:
    lines = ["| system | requests | failed | TTFT p50 | TTFT p99 | ITL p50 | ITL mean | tokens/s | wall | "
             "prompt tokens | cached tokens by tier | preemptions | computed tokens | KV loaded | "
             "step-thread tier I/O | transfer worker | same text as generate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cached = ", ".join(f"{k}: {v}" for k, v in r["cached_tokens_by_tier"].items()) or "–"
        same = {None: "(reference)", True: "yes", False: "NO"}[r["same_text_as_generate"]]
        lines.append(f"| {r['system']} | {r['requests']} | {r['failed']} | {r['ttft_p50_s'] * 1000:,.0f} ms | "
                     f"{r['ttft_p99_s'] * 1000:,.0f} ms | {r['itl_p50_s'] * 1000:,.0f} ms | "
                     f"{r['itl_mean_s'] * 1000:,.0f} ms | {r['tokens_per_s']:.1f} | {r['wall_s']:.1f} s | "
                     f"{r['prompt_tokens']:,} | {cached} | {r['preemptions']} | "
                     f"{r.get('computed_tokens', 0):,} | {r.get('moved_bytes', 0) / 1e6:,.1f} MB | "
                     f"{r.get('step_tier_io_s', 0.0):.2f} s | {r.get('transfer_s', 0.0):.2f} s | {same} |")
    return "\n".join(lines)


def plot(rows: list[dict], path, title: str) -> None:
    """Two panels per system: TTFT p50 / p99 (s) and tokens/s (failed requests marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [r["system"] for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    ax1.bar(x - 0.2, [r["ttft_p50_s"] for r in rows], 0.4, label="TTFT p50")
    ax1.bar(x + 0.2, [r["ttft_p99_s"] for r in rows], 0.4, label="TTFT p99")
    ax1.set_ylabel("seconds")
    ax1.legend()
    colors = ["#999" if n == "generate" else ("#2a7" if n.startswith("kvtier") else "#c84") for n in names]
    ax2.bar(x, [r["tokens_per_s"] for r in rows], color=colors)
    ax2.set_ylabel("generated tokens / s")
    for i, r in enumerate(rows):
        note = f"{r['tokens_per_s']:.1f}" + (f"\n{r['failed']} failed" if r["failed"] else "")
        ax2.text(i, r["tokens_per_s"], note, ha="center", va="bottom", fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(x, names, rotation=15, fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(rows: list[dict], path, title: str) -> None:
    """Per system, one line per request in submission order: waiting for its first token (queue, load,
    prefill: light), then decoding (dark), with a red tick at each gap longer than twice the system's
    median gap (a step that stalled: a load, a long prefill beside it, a preemption)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("timeline")]
    if not rows:
        return
    fig, axes = plt.subplots(len(rows), 1, figsize=(12, 1.2 + 0.12 * max(len(r["timeline"]) for r in rows) * len(rows)),
                             sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        gaps = sorted(g for req in r["timeline"] for g in req["itl_s"])
        stall_s = 2 * gaps[len(gaps) // 2] if gaps else float("inf")
        for y, req in enumerate(r["timeline"]):
            ax.barh(y, req["first_token_s"] - req["start_s"], left=req["start_s"], color="#cfd8e3", height=0.8)
            ax.barh(y, req["end_s"] - req["first_token_s"], left=req["first_token_s"], color="#2a6f97", height=0.8)
            t = req["first_token_s"]
            for gap in req["itl_s"]:
                t += gap
                if gap > stall_s:
                    ax.plot([t, t], [y - 0.4, y + 0.4], color="#d62828", linewidth=1)
        ax.set_ylabel(r["system"], rotation=0, ha="right", fontsize=8)
        ax.set_yticks([])
        ax.invert_yaxis()
        ax.text(1.0, 0.02, f"wall {r['wall_s']:.0f} s, TTFT p50 {r['ttft_p50_s']:.1f} s, ITL p50 "
                f"{r['itl_p50_s'] * 1000:.0f} ms", transform=ax.transAxes, ha="right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds since the system's run began (light: waiting for the first token; dark: "
                           "decoding; red: a gap > 2x the median)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
