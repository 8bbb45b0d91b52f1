"""Hypothesis strategies for KV tensors: normal, outliers, zeros, constants, tiny and huge magnitudes."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
KINDS = ("normal", "outliers", "zeros", "constant", "tiny", "huge", "one_sign", "spiky_channel")


def make_tensor(shape: tuple[int, ...], kind: str, seed: int, max_abs: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if kind == "outliers":  # ~2% of elements 100-1000x bigger, KV's massive activations
        mask = torch.rand(shape, generator=gen) < 0.02
        x = torch.where(mask, x * 300.0, x)
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "constant":
        x = torch.full(shape, float(x.flatten()[0]) * 7.0)
    elif kind == "tiny":
        x = x * 1e-6
    elif kind == "huge":
        x = x * max_abs / 4
    elif kind == "one_sign":
        x = x.abs() + 3.0
    elif kind == "spiky_channel":  # one channel far bigger than the rest (KIVI's case for per-channel keys)
        x[..., 0] *= 200.0
    return x.clamp(-max_abs, max_abs)


@st.composite
def tensors(draw, *, rank: int = 4, max_abs: float = 6e4, dtypes=DTYPES) -> torch.Tensor:
    """[a, b, T, D] (rank 4) or [L, 2, H, T, D] (rank 5) with T and D off the group multiples."""
    lead = [draw(st.integers(1, 2)) for _ in range(rank - 2)]
    if rank == 5:
        lead[1] = 2
    shape = (*lead, draw(st.integers(1, 70)), draw(st.sampled_from([1, 3, 8, 16, 20, 64])))
    kind, seed = draw(st.sampled_from(KINDS)), draw(st.integers(0, 2**31 - 1))
    return make_tensor(shape, kind, seed, max_abs).to(draw(st.sampled_from(dtypes)))
