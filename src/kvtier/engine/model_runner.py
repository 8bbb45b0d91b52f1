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
from kvtier.engine.attention import AttentionMetadata, PagedStep, make_backend, paged_model
from kvtier.engine.cpu_linear import use_cpu_linear
from kvtier.offload.attention import OffloadAttention, SeqOffload, window_positions
from kvtier.engine.sampler import Penalties, logprobs_of, process_logits, sample
from kvtier.engine.scheduler import ScheduledChunk
from kvtier.engine.sequence import TokenLogprob

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunOutput:
    token_ids: dict[str, int] = field(default_factory=dict)  # request id -> the token sampled for it
    errors: dict[str, str] = field(default_factory=dict)     # request id -> why it could not be sampled
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # request id -> its sampled token's (if asked)
    # request id -> (position p, logprobs of prompt tokens p+1, p+2, ...) computed this step (prompt_logprobs asked)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: KVLayout, arena: Arena,
                 eos_token_ids: tuple[int, ...] = (), offload: OffloadAttention | None = None) -> None:
        self.model = paged_model(model)
        use_cpu_linear(self.model)  # the linears at the CPU's speed: a decode's at the weights' bandwidth (fp32)
        self.decoder = self.model.get_decoder()
        self.lm_head = self.model.get_output_embeddings()
        self.layout = layout
        self.arena = arena  # the whole device KV budget, allocated once
        # the CPU paged kernel (raw arenas) or the gather path; a paged CUDA kernel would read the same metadata
        self.backend = make_backend(arena, offload)
        self.device = arena.device
        self.eos_token_ids = list(eos_token_ids)  # masked until a request's min_tokens
        self._generators: dict[str, torch.Generator] = {}

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> RunOutput:
        """Compute the chunks' tokens; sample a next token for each sequence whose chunk ends its tokens.
        Raises if the forward fails (every chunk's KV is suspect); a row that cannot be sampled is
        an error of that sequence alone."""
        meta, input_ids, positions, last_rows, prompt_rows = self._prepare(chunks)
        self.backend.begin_step(meta)
        try:
            hidden = self.decoder(input_ids=input_ids, position_ids=positions,
                                  kvtier_step=PagedStep(self.backend, meta), use_cache=False).last_hidden_state
        finally:  # also after a failed forward (the engine fails that step's sequences and goes on)
            self.backend.end_step()
        # lm_head only on the rows that sample, and on the prompt rows of requests that asked for prompt logprobs
        rows = [row for _, row in last_rows] + [row for _, _, rows_ in prompt_rows for row in rows_]
        if not rows:
            return RunOutput()
        logits = self.lm_head(hidden[0, rows]).float()  # [S + prompt rows, vocab]
        out = self._sample([seq for seq, _ in last_rows], logits[:len(last_rows)]) if last_rows else RunOutput()
        self._prompt_logprobs(prompt_rows, logits[len(last_rows):], out)
        return out

    def _prepare(self, chunks: list[ScheduledChunk]):
        """The step's flat batch and its attention metadata, built once."""
        block_tokens = self.layout.block_tokens
        token_ids, positions, slot_blocks, slot_offsets, last_rows, prompt_rows = [], [], [], [], [], []
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
            block_tables.append(seq.block_ids[:-(-end // block_tokens)])
            offloads.append(None if seq.host is None else self._offload(seq, start, end, as_long))
            if end == seq.num_tokens:
                last_rows.append((seq, len(token_ids) - 1))
            # position p's logits score prompt token p + 1: rows up to the prompt's second-to-last token
            num_scoring = min(end, seq.num_prompt_tokens - 1) - start
            if seq.needs_prompt_logits and num_scoring > 0:
                first_row = query_start_loc[-2]
                prompt_rows.append((seq, start, list(range(first_row, first_row + num_scoring))))
        max_blocks = max(len(table) for table in block_tables)
        padded = [table + [0] * (max_blocks - len(table)) for table in block_tables]  # 0: a block never read
        meta = AttentionMetadata(torch.tensor(slot_blocks, **as_long), torch.tensor(slot_offsets, **as_long),
                                 query_start_loc, seq_lens, [torch.tensor(table, **as_long) for table in block_tables],
                                 offloads if any(o is not None for o in offloads) else [],
                                 torch.tensor(padded, **as_long), torch.tensor(seq_lens, **as_long),
                                 torch.tensor(query_start_loc, **as_long))
        return (meta, torch.tensor([token_ids], **as_long), torch.tensor([positions], **as_long), last_rows,
                prompt_rows)

    def _prompt_logprobs(self, prompt_rows, logits: torch.Tensor, out: RunOutput) -> None:
        """Logprobs of the prompt tokens that follow each prompt row's position (the last one's may be
        in the next chunk). A failure here is an error of those requests alone."""
        first = 0
        for seq, start, rows in prompt_rows:
            try:
                next_ids = torch.tensor(seq.token_ids[start + 1:start + 1 + len(rows)], device=self.device)
                scored = logprobs_of(logits[first:first + len(rows)], next_ids, seq.sampling.prompt_logprobs)
                out.prompt_logprobs[seq.request_id] = (start, scored)
            except Exception as exc:  # noqa: BLE001
                out.errors.setdefault(seq.request_id, f"prompt logprobs failed: {exc}")
            first += len(rows)

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
        for seq, (token, is_bad, logprob) in zip(seqs, rows):
            if is_bad:
                out.errors.setdefault(seq.request_id, "sampling failed: the model's logits are NaN")
            elif seq.request_id not in out.errors:
                out.token_ids[seq.request_id] = token
                if logprob is not None:
                    out.logprobs[seq.request_id] = logprob
        return out

    def _sample_rows(self, seqs: list, logits: torch.Tensor,
                     generators: list[torch.Generator | None]) -> list[tuple[int, bool, TokenLogprob | None]]:
        """(token id, could not be sampled, its logprobs if asked) per row: one batched op each for
        the processors, the draw and the logprobs."""
        params = [seq.sampling for seq in seqs]
        as_float = dict(dtype=torch.float32, device=self.device)
        temperatures = torch.tensor([p.temperature for p in params], **as_float)
        top_ps = torch.tensor([p.top_p for p in params], **as_float)
        top_ks = torch.tensor([p.top_k for p in params], dtype=torch.long, device=self.device)
        min_ps = torch.tensor([p.min_p for p in params], **as_float)
        processed = process_logits(logits, self._bias(seqs, logits.shape[-1]), self._penalties(seqs, logits.shape[-1]))
        token_ids, bad = sample(processed, temperatures, top_ps, generators, top_ks=top_ks, min_ps=min_ps)
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if wanted:
            num_top = max(params[i].logprobs for i in wanted)
            for i, lp in zip(wanted, logprobs_of(logits[wanted], token_ids[wanted], num_top)):
                lp.top = lp.top[:params[i].logprobs]
                logprobs[i] = lp
        return list(zip(token_ids.tolist(), bad.tolist(), logprobs))

    def _bias(self, seqs: list, vocab: int) -> torch.Tensor | None:
        """[S, vocab]: logit_bias, -inf outside allowed_token_ids, and -inf on EOS and stop_token_ids
        until min_tokens; None when no row has any."""
        entries: list[tuple[int, int, float]] = []   # (row, token id, value)
        allowed: list[tuple[int, list[int]]] = []
        for row, seq in enumerate(seqs):
            p = seq.sampling
            entries += [(row, token, bias) for token, bias in p.logit_bias.items()]
            if seq.num_generated_tokens < p.min_tokens:
                entries += [(row, token, float("-inf")) for token in {*p.stop_token_ids, *self.eos_token_ids}]
            if p.allowed_token_ids is not None:
                allowed.append((row, p.allowed_token_ids))
        if not entries and not allowed:
            return None
        bias = torch.zeros(len(seqs), vocab, dtype=torch.float32, device=self.device)
        for row, token_ids in allowed:
            bias[row] = float("-inf")
            bias[row, token_ids] = 0.0
        if entries:
            rows, tokens, values = zip(*entries)
            bias.index_put_((torch.tensor(rows, device=self.device), torch.tensor(tokens, device=self.device)),
                            torch.tensor(values, dtype=torch.float32, device=self.device), accumulate=True)
        return bias

    def _penalties(self, seqs: list, vocab: int) -> Penalties | None:
        if not any(seq.sampling.penalized for seq in seqs):
            return None
        as_float = dict(dtype=torch.float32, device=self.device)

        def padded(id_lists: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(ids) for ids in id_lists))
            return torch.tensor([ids + [vocab] * (width - len(ids)) for ids in id_lists], dtype=torch.long,
                                device=self.device)
        return Penalties(torch.tensor([s.sampling.repetition_penalty for s in seqs], **as_float),
                         torch.tensor([s.sampling.presence_penalty for s in seqs], **as_float),
                         torch.tensor([s.sampling.frequency_penalty for s in seqs], **as_float),
                         padded([s.token_ids[s.num_prompt_tokens:] if s.sampling.penalized else [] for s in seqs]),
                         padded([s.token_ids if s.sampling.penalized else [] for s in seqs]))

    def _sample_alone(self, seq, logits: torch.Tensor, generator,
                      errors: dict[str, str]) -> tuple[int, bool, TokenLogprob | None]:
        try:
            return self._sample_rows([seq], logits, [generator])[0]
        except Exception as exc:  # noqa: BLE001
            errors.setdefault(seq.request_id, f"sampling failed: {exc}")
            return -1, True, None

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
