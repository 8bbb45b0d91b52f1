"""The device side: the KV arena tensors, the forward over a step's flat batch, and sampling.

Reads only what the scheduler hands it (`ScheduledChunk`s with their sequences' block tables);
never decides anything. Block copies to and from host memory and tier blocks go through here too.
"""

from __future__ import annotations

import torch

from kvtier.blocks import KVLayout
from kvtier.engine.attention import PagedBatch, SeqSlice, kv_index, paged_model
from kvtier.engine.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.model = paged_model(model)
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.layout = layout
        self.device = device
        self.dtype = getattr(torch, layout.dtype)
        shape = (layout.num_layers, num_blocks, layout.num_kv_heads, layout.block_tokens, layout.head_dim)
        # [L, num_blocks, H, T, D]: the whole device KV budget, allocated once
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=device)
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        """Compute the chunks' tokens; sample a next token for each sequence whose chunk ends its tokens."""
        batch, input_ids, positions, last_rows = self._prepare(chunks)
        hidden = self.decoder(input_ids=input_ids, position_ids=positions, kvtier_batch=batch,
                              use_cache=False).last_hidden_state
        if not last_rows:
            return {}
        logits = self.lm_head(hidden[0, [row for _, row in last_rows]]).float()  # [S, vocab]
        return {seq.request_id: self._sample(seq, logits[i]) for i, (seq, _) in enumerate(last_rows)}

    def _prepare(self, chunks: list[ScheduledChunk]):
        block_tokens = self.layout.block_tokens
        token_ids, positions, slot_blocks, slot_offsets, seqs, last_rows = [], [], [], [], [], []
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            q_start = len(token_ids)
            token_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slot_blocks += [seq.block_ids[p // block_tokens] for p in range(start, end)]
            slot_offsets += [p % block_tokens for p in range(start, end)]
            num_blocks = -(-end // block_tokens)
            table = torch.tensor(seq.block_ids[:num_blocks], dtype=torch.long, device=self.device)
            index = kv_index(table, end, self.layout.num_kv_heads, block_tokens)
            seqs.append(SeqSlice(q_start, len(token_ids), index, end))
            if end == seq.num_tokens:
                last_rows.append((seq, len(token_ids) - 1))
        as_long = dict(dtype=torch.long, device=self.device)
        batch = PagedBatch(self.k_cache, self.v_cache, torch.tensor(slot_blocks, **as_long),
                           torch.tensor(slot_offsets, **as_long), seqs)
        return (batch, torch.tensor([token_ids], **as_long), torch.tensor([positions], **as_long), last_rows)

    def _sample(self, seq, logits: torch.Tensor) -> int:
        sampling = seq.sampling
        if sampling.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / sampling.temperature, dim=-1)
        if sampling.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p
            probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
        return int(torch.multinomial(probs, 1, generator=self._generator(seq)))

    def _generator(self, seq) -> torch.Generator | None:
        if seq.sampling.seed is None:
            return None
        if seq.request_id not in self._generators:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seq.sampling.seed)
            self._generators[seq.request_id] = gen
        return self._generators[seq.request_id]

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    # -- block copies ------------------------------------------------------------------------------
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[L, 2, n, H, T, D] copy of the blocks (on the device; the caller moves it)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([self.k_cache[:, index], self.v_cache[:, index]], dim=1)

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Inverse of `read_blocks`; `kv` may live on the host."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        kv = kv.to(self.device, non_blocking=True)
        self.k_cache[:, index] = kv[:, 0]
        self.v_cache[:, index] = kv[:, 1]

    def block_tensor(self, block_id: int) -> torch.Tensor:
        """One block as a codec wants it: [L, 2, H, T, D] on the CPU."""
        return torch.stack([self.k_cache[:, block_id], self.v_cache[:, block_id]], dim=1).cpu()

    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        """Write one [L, 2, H, T, D] block (a decoded tier block)."""
        kv = kv.to(device=self.device, dtype=self.dtype)
        self.k_cache[:, block_id] = kv[:, 0]
        self.v_cache[:, block_id] = kv[:, 1]
