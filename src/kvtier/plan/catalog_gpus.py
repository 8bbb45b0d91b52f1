"""The built-in accelerator catalog, and `gpu_spec`.

HBM is what the driver reports (nvidia-smi / rocm-smi), which is why an "80GB" H100 holds
81559 MiB = 79.6 GiB. Bandwidth is the vendor's peak HBM figure, FLOP/s dense bf16 (no sparsity),
TDP the board power of the SXM/OAM part (PCIe for L40S and the RTX 4090).
"""

from __future__ import annotations

from dataclasses import replace

from kvtier.errors import UserError
from kvtier.plan.specs import GPUSpec

_MiB = 2**20

GPUS: dict[str, GPUSpec] = {g.name: g for g in [
    #        name         HBM bytes       bytes/s   bf16 FLOP/s  TDP W
    GPUSpec("h100", 81559 * _MiB, 3.35e12, 989e12, 700),
    GPUSpec("h200", 143771 * _MiB, 4.8e12, 989e12, 700),
    GPUSpec("b200", 183359 * _MiB, 8.0e12, 2250e12, 1000),
    GPUSpec("a100-40gb", 40960 * _MiB, 1.555e12, 312e12, 400),
    GPUSpec("a100-80gb", 81920 * _MiB, 2.039e12, 312e12, 400),
    GPUSpec("l40s", 46068 * _MiB, 0.864e12, 362e12, 350),
    GPUSpec("rtx-4090", 24564 * _MiB, 1.008e12, 165e12, 450),
    GPUSpec("mi300x", 196608 * _MiB, 5.3e12, 1307e12, 750),
]}
_ALIASES = {"h100-80gb": "h100", "h100-sxm": "h100", "h200-141gb": "h200", "a100": "a100-80gb",
            "a100-40g": "a100-40gb", "a100-80g": "a100-80gb", "4090": "rtx-4090", "b200-180gb": "b200"}


def gpu_spec(name: str) -> GPUSpec:
    """A catalog accelerator by name (case and `_`/`-` insensitive)."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _ALIASES.get(key, key)
    if key not in GPUS:
        raise UserError(f"unknown GPU {name!r}: use one of {', '.join(GPUS)}, or --gpu-mem")
    return GPUS[key]


def with_memory(gpu: GPUSpec, hbm_bytes: int) -> GPUSpec:
    """An accelerator not in the catalog: `gpu`'s bandwidth, FLOP/s and TDP with `hbm_bytes` of memory."""
    if hbm_bytes <= 0:
        raise UserError(f"--gpu-mem must be positive, got {hbm_bytes} bytes")
    return replace(gpu, name=f"{gpu.name}-like, {hbm_bytes / 1e9:g} GB", hbm_bytes=hbm_bytes)
