"""The device side: the KV arena tensors, the forward over a step's flat batch, and sampling.

Reads only what the scheduler hands it (`ScheduledChunk`s with their sequences' block tables);
never decides anything. The KV lives in an arena (`kvtier.engine.arena`, raw or quantized); the
engine copies blocks in and out of it (swaps, tiers) directly.
"""

from __future__ import annotations

import torch

from kvtier.blocks import KVLayout
from kvtier.engine.arena import Arena
from kvtier.engine.attention import AttentionMetadata, PagedStep, SDPABackend, paged_model
from kvtier.engine.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: KVLayout, arena: Arena) -> None:
        self.model = paged_model(model)
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.layout = layout
        self.arena = arena  # the whole device KV budget, allocated once
        self.backend = SDPABackend(arena)  # the CPU path; a paged CUDA kernel would read the same metadata
        self.device = arena.device
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> dict[str, int]:
        """Compute the chunks' tokens; sample a next token for each sequence whose chunk ends its tokens."""
        meta, input_ids, positions, last_rows = self._prepare(chunks)
        self.backend.begin_step(meta)
        try:
            hidden = self.decoder(input_ids=input_ids, position_ids=positions,
                                  kvtier_step=PagedStep(self.backend, meta), use_cache=False).last_hidden_state
        finally:  # also after a failed forward (the server aborts that step's requests and goes on)
            self.backend.end_step()
        if not last_rows:
            return {}
        logits = self.lm_head(hidden[0, [row for _, row in last_rows]]).float()  # [S, vocab]
        return {seq.request_id: self._sample(seq, logits[i]) for i, (seq, _) in enumerate(last_rows)}

    def _prepare(self, chunks: list[ScheduledChunk]):
        """The step's flat batch and its attention metadata, built once."""
        block_tokens = self.layout.block_tokens
        token_ids, positions, slot_blocks, slot_offsets, last_rows = [], [], [], [], []
        query_start_loc, seq_lens, block_tables = [0], [], []
        as_long = dict(dtype=torch.long, device=self.device)
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
            token_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slot_blocks += [seq.block_ids[p // block_tokens] for p in range(start, end)]
            slot_offsets += [p % block_tokens for p in range(start, end)]
            query_start_loc.append(len(token_ids))
            seq_lens.append(end)
            block_tables.append(torch.tensor(seq.block_ids[:-(-end // block_tokens)], **as_long))
            if end == seq.num_tokens:
                last_rows.append((seq, len(token_ids) - 1))
        meta = AttentionMetadata(torch.tensor(slot_blocks, **as_long), torch.tensor(slot_offsets, **as_long),
                                 query_start_loc, seq_lens, block_tables)
        return (meta, torch.tensor([token_ids], **as_long), torch.tensor([positions], **as_long), last_rows)

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
