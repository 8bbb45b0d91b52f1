"""Memory per GPU against context length, with the HBM capacity line (matplotlib, Agg backend)."""

from __future__ import annotations

from kvtier.plan.sizing import GIB, PlanResult
from kvtier.plan.specs import ModelSpec


def plot(model: ModelSpec, result: PlanResult, path: str) -> None:
    """Weights + KV + activations + overhead per GPU at the plan's concurrency, for contexts up to
    twice the planned one (or the model's max), against usable and total HBM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    contexts = np.unique(np.linspace(1, max(result.context * 2, model.max_context), 400).astype(int))
    fixed = result.weights_bytes_per_gpu + result.activations_bytes + result.overhead_bytes
    kv = np.array([model.kv_bytes(int(c), result.kv_dtype, result.tp) for c in contexts]) * result.concurrency
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.plot(contexts, (fixed + kv) / GIB, lw=2, label=f"weights + KV + act. + overhead ({result.concurrency} requests)")
    ax.axhline(fixed / GIB, color="gray", ls=":", label="weights + activations + overhead")
    ax.axhline(result.gpu_mem_bytes / GIB, color="red", label=f"{result.gpu} HBM {result.gpu_mem_bytes / GIB:.1f} GiB")
    ax.axhline(result.usable_bytes / GIB, color="red", ls="--", label=f"usable {result.usable_bytes / GIB:.1f} GiB")
    ax.axvline(result.context, color="black", ls="--", lw=0.8, label=f"planned context {result.context:,}")
    if 0 < result.max_context < contexts[-1]:
        ax.axvline(result.max_context, color="green", ls="-.", lw=0.8, label=f"max context {result.max_context:,}")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("memory per GPU (GiB = 2^30 B)")
    ax.set_title(f"{model.name} on {result.gpu} x tp{result.tp}: KV {result.kv_dtype}, weights {result.weight_dtype}")
    # keep the HBM line readable when the KV at 2x context dwarfs it
    top = max(1.2 * result.gpu_mem_bytes, min((fixed + kv[-1]) * 1.05, 4 * result.gpu_mem_bytes))
    ax.set_ylim(0, top / GIB)
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
