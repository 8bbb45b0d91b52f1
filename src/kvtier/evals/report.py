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
SPARSE_TARGET_LABEL = "sparse-1/8"    # issue 18: sparse offload at 1/8 of the host blocks
SPARSE_MAX_PASSKEY_DROP = 0.05
SPARSE_MAX_DELTA_PCT = 2.0


@dataclass(slots=True)
class TargetCheck:
    name: str
    met: bool | None   # None: not measured in this run
    detail: str


def rows_to_json(rows: list[EvalRow]) -> list[dict]:
    return [asdict(row) for row in rows]


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(100 * value, spec) + "%"


def table(rows: list[EvalRow], title: str) -> Table:
    out = Table(title=title)
    offload = any(row.method == "sparse" for row in rows)
    names = ["method", "bits / budget", "bytes/token", "compression", "ppl", "Δppl %", "passkey acc"]
    if offload:  # where the KV is while decoding: what sparse offload trades
        names += ["device KV MiB", "fetched KiB/token", "attended"]
    for name in names + ["note"]:
        out.add_column(name, justify="left" if name in ("method", "bits / budget", "note") else "right")
    for row in rows:
        cells = [row.label, row.bits_or_budget, _fmt(row.bytes_per_token, ",.0f"),
                 _fmt(row.compression, ".2f") + ("×" if row.compression else ""),
                 _fmt(row.ppl, ".3f"), _fmt(row.delta_ppl_pct, "+.2f"), _pct(row.passkey_acc)]
        if offload:
            cells += [_fmt(None if row.device_kv_bytes is None else row.device_kv_bytes / 2**20, ",.1f"),
                      _fmt(None if row.fetched_bytes_per_token is None else row.fetched_bytes_per_token / 2**10,
                           ",.0f"),
                      _pct(row.attended_fraction, ".1f")]
        out.add_row(*cells, row.error or "")
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
    checks += _sparse_checks(by_label)
    return checks


def _sparse_checks(by_label: dict[str, EvalRow]) -> list[TargetCheck]:
    """Issue 18: sparse offload at 1/8 — passkey within 5 points of full attention, Δppl ≤ 2%."""
    raw, row = by_label.get("raw"), by_label.get(SPARSE_TARGET_LABEL)
    if raw is None or row is None:
        return []
    checks = []
    if raw.passkey_acc is not None and row.passkey_acc is not None:
        checks.append(TargetCheck("sparse offload at 1/8: passkey within 5 points of full attention",
                                  raw.passkey_acc - row.passkey_acc <= SPARSE_MAX_PASSKEY_DROP + 1e-9,
                                  f"{100 * row.passkey_acc:.0f}% vs {100 * raw.passkey_acc:.0f}%"))
    if row.delta_ppl_pct is not None:
        checks.append(TargetCheck("sparse offload at 1/8: Δppl ≤ 2%", row.delta_ppl_pct <= SPARSE_MAX_DELTA_PCT,
                                  f"Δppl {row.delta_ppl_pct:+.3f}%"))
    return checks


def plot(rows: list[EvalRow], path: Path, title: str) -> None:
    """Two panels against compression: Δperplexity % and passkey accuracy (with sparse offload in the grid:
    against the share of the context each decode step attends to, `plot_offload`)."""
    if any(row.method == "sparse" for row in rows):
        return plot_offload(rows, path, title)
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


def plot_offload(rows: list[EvalRow], path: Path, title: str) -> None:
    """Δperplexity % and passkey accuracy against the share of the context a decode step attends to:
    sparse offload (every token kept, the top blocks fetched) beside the eviction levers (tokens dropped for
    good) at the same budgets, full attention as the dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    families: dict[str, list[EvalRow]] = {}
    for row in rows:
        if row.error is None and row.attended_fraction is not None and (row.method == "sparse" or row.keep is not None):
            families.setdefault(_family(row), []).append(row)
    raw = next((row for row in rows if row.label == "raw" and row.error is None), None)
    for name, members in families.items():
        members.sort(key=lambda row: row.attended_fraction)
        xs = [100 * row.attended_fraction for row in members]
        style = dict(marker="o", linewidth=2.5) if name.startswith("sparse") else dict(marker="s", linestyle="--")
        style["color"] = f"C{list(families).index(name)}"  # one color per line in both panels
        if any(row.delta_ppl_pct is not None for row in members):
            left.plot(xs, [row.delta_ppl_pct for row in members], label=name, **style)
        if any(row.passkey_acc is not None for row in members):
            right.plot(xs, [100 * row.passkey_acc if row.passkey_acc is not None else float("nan") for row in members],
                       label=name, **style)
        if name.startswith("sparse"):
            for row, x in zip(members, xs):
                for ax, y in ((left, row.delta_ppl_pct), (right, None if row.passkey_acc is None else 100 * row.passkey_acc)):
                    if y is not None:
                        ax.annotate(row.label.split("-")[1], (x, y), fontsize=8, xytext=(4, 4),
                                    textcoords="offset points")
    if raw is not None:
        left.axhline(0.0, color="black", linestyle=":", label="full attention")
        if raw.passkey_acc is not None:
            right.axhline(100 * raw.passkey_acc, color="black", linestyle=":", label="full attention")
    left.set_yscale("symlog", linthresh=1.0)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8, 16, 32, 64, 100])
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    left.set(xlabel="context attended per decode step (%)", ylabel="Δ perplexity % (symlog)", title="Perplexity cost")
    right.set(xlabel="context attended per decode step (%)", ylabel="passkey accuracy %", title="Passkey retrieval",
              ylim=(-5, 105))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _family(row: EvalRow) -> str:
    """A line of the offload plot: sparse offload per block size / window (sparse-1/8-b16 -> "... b16"), else
    the eviction policy (h2o@0.125 -> h2o)."""
    if row.method != "sparse":
        return row.label.split("@")[0]
    layout = " ".join(row.label.split("-")[2:])
    return "sparse offload (Quest top-k)" + (f" {layout}" if layout else "")
