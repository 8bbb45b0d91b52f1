"""The runner builds one AttentionMetadata per step and every attention layer reads it through the
step's backend: exact slot mapping, query ranges, sequence lengths and block tables for a mixed
prefill + decode step; a wrapping backend sees every layer and changes nothing."""

import sys
from pathlib import Path

from kvtier.engine import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402
from test_engine import BLOCK, make_engine  # noqa: E402


class Recording:
    def __init__(self, inner):
        self.inner, self.metas, self.layers = inner, [], []

    def begin_step(self, meta):
        self.metas.append(meta)
        self.inner.begin_step(meta)

    def forward(self, layer, query, key, value, meta, scaling):
        assert meta is self.metas[-1]  # one metadata object per step, shared by every layer
        self.layers.append(layer)
        return self.inner.forward(layer, query, key, value, meta, scaling)

    def end_step(self):
        self.inner.end_step()


def test_metadata_of_a_mixed_step_and_a_pluggable_backend(tiny_model, tiny_prompts):
    engine = make_engine(tiny_model, 32, max_prefill_tokens=64)
    backend = engine.runner.backend = Recording(engine.runner.backend)
    outputs: dict[str, list[int]] = {}

    def step():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    engine.add_request("a", tiny_prompts[1], SamplingParams(max_tokens=4))   # 17 tokens
    step()                                                                     # prefill of a
    engine.add_request("b", tiny_prompts[0], SamplingParams(max_tokens=4))   # 5 tokens
    step()                                                                     # a decodes, b prefills
    meta = backend.metas[-1]
    a, b = (engine._seqs[r] for r in ("a", "b"))
    assert meta.query_start_loc == [0, 1, 6] and meta.seq_lens == [18, 5] and meta.num_seqs == 2
    assert meta.block_tables[0].tolist() == a.block_ids[:3] and meta.block_tables[1].tolist() == b.block_ids[:1]
    assert meta.slot_block_ids.tolist() == [a.block_ids[2]] + [b.block_ids[0]] * 5
    assert meta.slot_offsets.tolist() == [17 % BLOCK, 0, 1, 2, 3, 4]
    num_layers = tiny_model.model.config.num_hidden_layers
    assert backend.layers == list(range(num_layers)) * 2
    while engine.has_unfinished_requests():
        step()
    assert outputs == {"a": reference(tiny_model.model, tiny_prompts[1], 4),
                       "b": reference(tiny_model.model, tiny_prompts[0], 4)}
