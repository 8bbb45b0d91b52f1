"""Offloaded decode on the CPU: the host blocks attended to where they sit in host memory, one kernel call a layer.

On a CPU device the DRAM tier's slots and the device arena are the same memory: copying a host block into the
fetch area before attending to it moves every byte twice (the copy, then the attention's read). A decode step of
an offloaded sequence instead runs `paged_kernel.paged_decode_two` once per layer over two sources, merged inside
the kernel by log-sum-exp: its host blocks (exact) or each KV head's picked pages (sparse), read through element
offsets into the slots' view (`FetchArea.host`), and its device window (sinks + recent, as the arena's gather
returns it). Nothing is copied and no fetch thread runs for it; what it reads counts as fetched bytes (what a
GPU's link would carry), with no fetch time. Prefill chunks (several queries, causal over the window) and
CUDA keep the fetch area (`OffloadAttention`).
"""

from __future__ import annotations

import torch

from kvtier.engine import paged_kernel

MAX_GROUP = 8  # query heads per KV head the kernel's decode rows hold (kRows)


class InPlaceDecode:
    """Decode attention of offloaded sequences over `host` ([num_slots, L, 2, H, T, D], CPU: the DRAM tier's
    slots) read in place, in units of `page_tokens` (sparse) or whole blocks (exact)."""

    def __init__(self, host: torch.Tensor, page_tokens: int) -> None:
        assert host.device.type == "cpu" and host.stride(-1) == 1 and host.stride(-2) == host.shape[-1], \
            "host blocks: each head's tokens D-contiguous rows"
        self.host = host
        self.block_tokens = host.shape[-2]
        self.page_tokens = page_tokens

    @staticmethod
    def usable(device: torch.device, num_heads: int, num_kv_heads: int) -> bool:
        """Whether decodes can run in place: a CPU device, the kernel built, a query group the kernel holds."""
        return (device.type == "cpu" and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP
                and paged_kernel.available())

    def exact_offsets(self, slots: torch.Tensor) -> torch.Tensor:
        """[H, 1, n]: element offsets, from a layer's K base, of every head's block in each of `slots` (in order)."""
        heads = torch.arange(self.host.shape[3])
        return (slots[None, :] * self.host.stride(0) + heads[:, None] * self.host.stride(3))[:, None].contiguous()

    def page_offsets(self, slots: torch.Tensor, blocks: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """[H, 1, k]: offsets of each head's picked pages (`pages.pick_pages`: blocks [k, H], indices into `slots`,
        and the page in each [k, H], in context order)."""
        heads = torch.arange(self.host.shape[3])
        offsets = (slots[blocks] * self.host.stride(0) + heads * self.host.stride(3)
                   + pages * self.page_tokens * self.host.stride(4))  # [k, H]
        return offsets.T[:, None].contiguous()

    def forward(self, layer: int, q: torch.Tensor, k_dev: torch.Tensor, v_dev: torch.Tensor, offsets: torch.Tensor,
                unit_tokens: int, scale: float) -> torch.Tensor:
        """q [Hq, 1, D] (one decode query); k_dev, v_dev [H, m, D] (its device window); offsets [H, 1, n] of units
        of `unit_tokens` host tokens -> out [Hq, 1, D] over the host units and the window."""
        hq, _, d = q.shape
        h, m = k_dev.shape[:2]
        if k_dev.stride(-1) != 1 or k_dev.stride(-2) != d or v_dev.stride() != k_dev.stride():
            k_dev, v_dev = k_dev.contiguous(), v_dev.contiguous()  # the kernel reads both with one layout
        q32 = q.transpose(0, 1).float()  # [1, Hq, D]
        if q32.stride(-1) != 1:
            q32 = q32.contiguous()
        out = torch.empty((1, hq, d), dtype=torch.float32)
        window = (torch.arange(h) * k_dev.stride(0)).view(h, 1, 1)
        paged_kernel.paged_decode_two(out, q32, self.host[:, layer, 0], self.host[:, layer, 1], offsets,
                                      torch.tensor([offsets.shape[-1] * unit_tokens]), unit_tokens, k_dev, v_dev,
                                      window, torch.tensor([m]), m, torch.zeros(1, dtype=torch.long), scale)
        return out.transpose(0, 1).to(q.dtype)
