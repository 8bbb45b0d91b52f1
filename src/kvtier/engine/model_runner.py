"""The device side: the KV arena tensors, the forward over a step's flat batch, and sampling.

Reads only what the scheduler hands it (`ScheduledChunk`s with their sequences' block tables);
never decides anything. The KV lives in an arena (`kvtier.engine.arena`, raw or quantized); the
engine copies blocks in and out of it (tier loads and stores) directly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kvtier.blocks import KVLayout
from kvtier.engine.arena import Arena
from kvtier.engine.attention import AttentionMetadata, PagedStep, SDPABackend, paged_model
from kvtier.engine.offload import OffloadAttention, SeqOffload, window_positions
from kvtier.engine.sampler import sample
from kvtier.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunOutput:
    token_ids: dict[str, int] = field(default_factory=dict)  # request id -> the token sampled for it
    errors: dict[str, str] = field(default_factory=dict)     # request id -> why it could not be sampled


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: KVLayout, arena: Arena,
                 offload: OffloadAttention | None = None) -> None:
        self.model = paged_model(model)
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.layout = layout
        self.arena = arena  # the whole device KV budget, allocated once
        # the CPU path; a paged CUDA kernel would read the same metadata
        self.backend = SDPABackend(arena, offload)
        self.device = arena.device
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> RunOutput:
        """Compute the chunks' tokens; sample a next token for each sequence whose chunk ends its tokens.
        Raises if the forward fails (every chunk's KV is suspect); a row that cannot be sampled is
        an error of that sequence alone."""
        meta, input_ids, positions, last_rows = self._prepare(chunks)
        self.backend.begin_step(meta)
        try:
            hidden = self.decoder(input_ids=input_ids, position_ids=positions,
                                  kvtier_step=PagedStep(self.backend, meta), use_cache=False).last_hidden_state
        finally:  # also after a failed forward (the engine fails that step's sequences and goes on)
            self.backend.end_step()
        if not last_rows:
            return RunOutput()
        logits = self.lm_head(hidden[0, [row for _, row in last_rows]]).float()  # [S, vocab]
        return self._sample([seq for seq, _ in last_rows], logits)

    def _prepare(self, chunks: list[ScheduledChunk]):
        """The step's flat batch and its attention metadata, built once."""
        block_tokens = self.layout.block_tokens
        token_ids, positions, slot_blocks, slot_offsets, last_rows = [], [], [], [], []
        query_start_loc, seq_lens, block_tables, offloads = [0], [], [], []
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
            offloads.append(None if seq.host is None else self._offload(seq, start, end, as_long))
            if end == seq.num_tokens:
                last_rows.append((seq, len(token_ids) - 1))
        meta = AttentionMetadata(torch.tensor(slot_blocks, **as_long), torch.tensor(slot_offsets, **as_long),
                                 query_start_loc, seq_lens, block_tables,
                                 offloads if any(o is not None for o in offloads) else [])
        return (meta, torch.tensor([token_ids], **as_long), torch.tensor([positions], **as_long), last_rows)

    def _offload(self, seq, start: int, end: int, as_long: dict) -> SeqOffload:
        """An offloaded sequence's step: its host blocks, its device window's positions."""
        host = seq.host
        n = len(host.slots)
        return SeqOffload(host.mode, torch.tensor(host.slots, dtype=torch.long),
                          host.summaries[:n] if host.summaries is not None else None,
                          torch.arange(start, end, device=self.device),
                          torch.tensor(window_positions(seq.block_ids, self.layout.block_tokens, end), **as_long),
                          end - start == 1, host.stats)

    def _sample(self, seqs: list, logits: torch.Tensor) -> RunOutput:
        """One batched op; if it raises, each row alone, so only the rows that fail are errors."""
        out = RunOutput()
        generators = [self._generator(seq, out.errors) for seq in seqs]
        try:
            rows = self._sample_rows(seqs, logits, generators)
        except Exception:  # noqa: BLE001 — find the culprit row(s)
            log.exception("batched sampling failed; sampling each of its %d rows alone", len(seqs))
            rows = [self._sample_alone(seq, logits[i:i + 1], generators[i], out.errors) for i, seq in enumerate(seqs)]
        for seq, (token, is_bad) in zip(seqs, rows):
            if is_bad:
                out.errors.setdefault(seq.request_id, "sampling failed: the model's logits are NaN")
            elif seq.request_id not in out.errors:
                out.token_ids[seq.request_id] = token
        return out

    def _sample_rows(self, seqs: list, logits: torch.Tensor,
                     generators: list[torch.Generator | None]) -> list[tuple[int, bool]]:
        """(token id, could not be sampled) per row."""
        as_float = dict(dtype=torch.float32, device=self.device)
        temperatures = torch.tensor([seq.sampling.temperature for seq in seqs], **as_float)
        top_ps = torch.tensor([seq.sampling.top_p for seq in seqs], **as_float)
        token_ids, bad = sample(logits, temperatures, top_ps, generators)
        return list(zip(token_ids.tolist(), bad.tolist()))

    def _sample_alone(self, seq, logits: torch.Tensor, generator, errors: dict[str, str]) -> tuple[int, bool]:
        try:
            return self._sample_rows([seq], logits, [generator])[0]
        except Exception as exc:  # noqa: BLE001
            errors.setdefault(seq.request_id, f"sampling failed: {exc}")
            return -1, True

    def _generator(self, seq, errors: dict[str, str]) -> torch.Generator | None:
        """The request's own generator (seeded requests), created on its first sample; a seed that
        torch refuses is an error of that request."""
        if seq.sampling.seed is None:
            return None
        if seq.request_id not in self._generators:
            gen = torch.Generator(device=self.device)
            try:
                gen.manual_seed(seq.sampling.seed)
            except (ValueError, RuntimeError, TypeError) as exc:
                errors[seq.request_id] = f"sampling failed: seed {seq.sampling.seed}: {exc}"
                return None
            self._generators[seq.request_id] = gen
        return self._generators[seq.request_id]

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
