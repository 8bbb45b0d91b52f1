"""Output of `kvtier eval`: the JSON rows, the rich table, the targets check and the PNG plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from rich.table import Table

from kvtier.evals.runner import EvalRow

INT8_MAX_DELTA_PCT = 0.5
INT4_MAX_DELTA_PCT = 3.0
INT4_MIN_COMPRESSION = 3.5
EVICTION_MAX_PASSKEY_DROP = 0.10


@dataclass(slots=True)
class TargetCheck:
    name: str
    met: bool | None   # None: not measured in this run
    detail: str


def rows_to_json(rows: list[EvalRow]) -> list[dict]:
    return [asdict(row) for row in rows]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[EvalRow], title: str) -> Table:
    out = Table(title=title)
    for name in ("method", "bits / budget", "bytes/token", "compression", "ppl", "Δppl %", "passkey acc", "note"):
        out.add_column(name, justify="left" if name in ("method", "bits / budget", "note") else "right")
    for row in rows:
        out.add_row(row.label, row.bits_or_budget, _fmt(row.bytes_per_token, ",.0f"),
                    _fmt(row.compression, ".2f") + ("×" if row.compression else ""),
                    _fmt(row.ppl, ".3f"), _fmt(row.delta_ppl_pct, "+.2f"),
                    _fmt(None if row.passkey_acc is None else 100 * row.passkey_acc, ".0f") +
                    ("%" if row.passkey_acc is not None else ""),
                    row.error or "")
    return out


def check_targets(rows: list[EvalRow]) -> list[TargetCheck]:
    by_label = {row.label: row for row in rows if row.error is None}
    checks = []
    int8 = by_label.get("int8")
    if int8 and int8.delta_ppl_pct is not None:
        checks.append(TargetCheck("int8 Δppl ≤ 0.5%", int8.delta_ppl_pct <= INT8_MAX_DELTA_PCT,
                                  f"int8 Δppl {int8.delta_ppl_pct:+.3f}%"))
    int4s = [row for label, row in by_label.items() if label.startswith("int4") and row.delta_ppl_pct is not None]
    if int4s:  # the best 4-bit layout: one that meets both, else the most compressed
        def meets(row):
            return row.delta_ppl_pct <= INT4_MAX_DELTA_PCT and row.compression >= INT4_MIN_COMPRESSION
        int4 = max(int4s, key=lambda row: (meets(row), row.compression))
        checks.append(TargetCheck("int4 Δppl ≤ 3% at ≥ 3.5×", meets(int4),
                                  f"{int4.label} Δppl {int4.delta_ppl_pct:+.3f}% at {int4.compression:.2f}×"))
    raw = by_label.get("raw")
    half = [row for row in by_label.values() if row.keep == 0.5 and row.passkey_acc is not None]
    if raw and raw.passkey_acc is not None and half:
        best = max(half, key=lambda row: row.passkey_acc)
        drop = raw.passkey_acc - best.passkey_acc
        checks.append(TargetCheck("best eviction at 50% kept within 10 points of full-cache passkey",
                                  drop <= EVICTION_MAX_PASSKEY_DROP + 1e-9,
                                  f"{best.label} {100 * best.passkey_acc:.0f}% vs full cache {100 * raw.passkey_acc:.0f}%"))
    return checks


def plot(rows: list[EvalRow], path: Path, title: str) -> None:
    """Two panels against compression: Δperplexity % and passkey accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    for row in rows:
        if row.compression is None:
            continue
        marker = "s" if row.keep is not None else ("^" if row.method.startswith("hf-") else "o")
        if row.delta_ppl_pct is not None:
            left.scatter(row.compression, row.delta_ppl_pct, marker=marker)
            left.annotate(row.label, (row.compression, row.delta_ppl_pct), fontsize=7,
                          xytext=(3, 3), textcoords="offset points")
        if row.passkey_acc is not None:
            right.scatter(row.compression, 100 * row.passkey_acc, marker=marker)
            right.annotate(row.label, (row.compression, 100 * row.passkey_acc), fontsize=7,
                           xytext=(3, 3), textcoords="offset points")
    left.set_yscale("symlog", linthresh=1.0)
    left.set(xlabel="KV compression vs 16-bit (×)", ylabel="Δ perplexity % (symlog)", title="Perplexity cost")
    right.set(xlabel="KV compression vs 16-bit (×)", ylabel="passkey accuracy %", title="Passkey retrieval",
              ylim=(-5, 105))
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
