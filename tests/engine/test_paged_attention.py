"""The CPU paged-attention kernel (`engine/paged_kernel.py`) against SDPA over the gathered context, and
`PagedBackend` in the engine: mixed prefill + decode batches, block boundaries, GQA, the BLAS, vector and
in-place paths, a subset of the step's sequences; greedy tokens equal to transformers' DynamicCache."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine import SamplingParams, attention, paged_kernel
from kvtier.engine.attention import PagedBackend, SDPABackend

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402
from test_engine import make_engine  # noqa: E402

pytestmark = pytest.mark.skipif(not paged_kernel.available(), reason="the paged kernel could not be built here")


@pytest.fixture(scope="module")
def refs(tiny_model, tiny_prompts):
    return [reference(tiny_model.model, p, 30) for p in tiny_prompts]


def _paged_case(seqs: list[tuple[int, int]], block_tokens: int, kv_heads: int, group: int, head_dim: int,
                dtype: torch.dtype = torch.float32, seed: int = 0):
    """A shuffled arena holding each (queries, context) sequence's context, and the kernel's inputs."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_tokens) for _, n in seqs) + 3
    shape = (num_blocks, kv_heads, block_tokens, head_dim)
    k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in "kv")
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for _, n in seqs:
        tables.append(order[used:used - (-n // block_tokens)])
        used += len(tables[-1])
    width = max(map(len, tables))
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    lens = torch.tensor([nq for nq, _ in seqs])
    starts = torch.cumsum(lens, 0) - lens
    q = torch.randn(int(lens.sum()), kv_heads * group, head_dim, generator=gen)
    return k, v, tables, block_table, torch.tensor([n for _, n in seqs]), starts, lens, q


def _sdpa(q, k, v, table, num_queries, context, scale):
    """One sequence by SDPA over its gathered context (the old path), in fp32: [num_queries, Hq, D]."""
    kk, vv = (x[table].float().transpose(0, 1).flatten(1, 2)[:, :context] for x in (k, v))  # [H, context, D]
    pos = torch.arange(context - num_queries, context)
    mask = torch.arange(context)[None, :] <= pos[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk[None], vv[None], attn_mask=mask, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)


# (queries, context): decodes at and across block boundaries, chunks starting mid-block, a whole prompt
MIXED = [(1, 1), (1, 8), (1, 9), (1, 64), (1, 65), (5, 70), (17, 17), (40, 128), (3, 200), (1, 333), (130, 130)]


# head dims of 1, 2, 3, 4 and 8 vectors of 16 and one of none (the decode rows' vector slices and their scalar path);
# groups of 1-4 rows and of 6 (a decode's rows taken four at a time)
@pytest.mark.parametrize("block_tokens,group,head_dim", [(8, 2, 16), (16, 3, 64), (64, 3, 64), (64, 1, 32),
                                                        (16, 4, 128), (16, 6, 48), (8, 2, 40)])
def test_kernel_equals_sdpa_over_the_gathered_context(block_tokens, group, head_dim):
    # T=8 / D=16 / D=32: the in-place dot products; T=16, 64 with D=64: BLAS for the long chunks, in place for decodes
    k, v, tables, block_table, seq_lens, starts, lens, q = _paged_case(MIXED, block_tokens, 2, group, head_dim)
    out = torch.full_like(q, float("nan"))
    paged_kernel.paged_attention(out, q, k, v, block_table, seq_lens, starts, lens, head_dim ** -0.5)
    for i, (num_queries, context) in enumerate(MIXED):
        rows = slice(int(starts[i]), int(starts[i] + lens[i]))
        expected = _sdpa(q[rows], k, v, tables[i], num_queries, context, head_dim ** -0.5)
        torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seqs", [[(1, 3000)], [(1, 2100), (2, 1500)], [(1, 1025), (1, 513)]])
def test_long_decodes_split_over_the_threads_equal_sdpa(seqs):
    # fewer items than threads: each decode's blocks in parts of whole 512-key chunks, merged by log-sum-exp
    k, v, tables, block_table, seq_lens, starts, lens, q = _paged_case(seqs, 64, 2, 3, 64)
    out = torch.empty_like(q)
    paged_kernel.paged_attention(out, q, k, v, block_table, seq_lens, starts, lens, 0.125)
    for i, (num_queries, context) in enumerate(seqs):
        rows = slice(int(starts[i]), int(starts[i] + lens[i]))
        torch.testing.assert_close(out[rows], _sdpa(q[rows], k, v, tables[i], num_queries, context, 0.125),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_reads_half_precision_kv(dtype):
    # the vector path (keys transposed, values converted per block) for many rows, in place for few
    k, v, tables, block_table, seq_lens, starts, lens, q = _paged_case(MIXED, 16, 2, 3, 64, dtype=dtype)
    out = torch.empty_like(q)
    paged_kernel.paged_attention(out, q, k, v, block_table, seq_lens, starts, lens, 0.125)
    for i, (num_queries, context) in enumerate(MIXED):
        rows = slice(int(starts[i]), int(starts[i] + lens[i]))
        torch.testing.assert_close(out[rows], _sdpa(q[rows], k, v, tables[i], num_queries, context, 0.125),
                                   rtol=1e-5, atol=1e-5)


def test_kernel_fills_only_its_sequences_rows_through_strides():
    k, v, tables, block_table, seq_lens, starts, lens, q = _paged_case(MIXED, 8, 2, 2, 16)
    keep = torch.tensor([0, 3, 5, 10])
    # q and out as the backend hands them: [N, Hq, D] views of [1, Hq, N, D] / [1, N, Hq, D] tensors
    q_view = q.transpose(0, 1).contiguous()[None][0].transpose(0, 1)
    out = torch.full((q.shape[0], q.shape[1], q.shape[2]), 7.0)
    paged_kernel.paged_attention(out, q_view, k, v, block_table[keep], seq_lens[keep], starts[keep], lens[keep], 0.25)
    for i in range(len(MIXED)):
        rows = slice(int(starts[i]), int(starts[i] + lens[i]))
        if i in keep.tolist():
            torch.testing.assert_close(out[rows], _sdpa(q[rows], k, v, tables[i], *MIXED[i], 0.25),
                                       rtol=1e-5, atol=1e-5)
        else:
            assert (out[rows] == 7.0).all()


def test_kernel_refuses_a_table_shorter_than_the_context():
    k, v, _, block_table, seq_lens, starts, lens, q = _paged_case([(1, 20)], 8, 2, 2, 16)
    with pytest.raises(RuntimeError, match="its lengths"):
        paged_kernel.paged_attention(torch.empty_like(q), q, k, v, block_table[:, :2], seq_lens, starts, lens, 0.25)


def test_backend_per_arena(tiny_model):
    for codec in ("raw", "fp8", "int8"):
        assert isinstance(make_engine(tiny_model, 16, kv_codec=codec).runner.backend, PagedBackend)
    assert type(make_engine(tiny_model, 64, kv_codec="int4", max_num_seqs=4).runner.backend) is SDPABackend


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_a_quantized_arena_through_the_kernel_equals_the_gather_path(tiny_model, tiny_prompts, codec):
    # the kernel reads the step's blocks dequantized once per layer (`arena.paged_kv`): the same KV the
    # gathers read, so the same tokens as an engine whose every sequence is gathered
    def tokens(gather_min_queries):
        engine = make_engine(tiny_model, 64, kv_codec=codec)
        engine.runner.backend.gather_min_queries = gather_min_queries
        return engine.generate(tiny_prompts, SamplingParams(max_tokens=30))
    assert tokens(10 ** 6) == tokens(1)


@pytest.mark.parametrize("gather_min_queries", [1, 4, 10 ** 6])
def test_engine_tokens_whichever_path_each_sequence_takes(tiny_model, tiny_prompts, refs, monkeypatch,
                                                          gather_min_queries):
    # 1: every sequence gathered (the old path); 10**6: every sequence through the kernel; 4: both in a step
    engine = make_engine(tiny_model, 64)
    backend = engine.runner.backend
    backend.gather_min_queries = gather_min_queries
    paths = []
    begin = backend.begin_step

    def recording(meta):
        begin(meta)
        paths.append((backend._paged is not None, bool(backend._seqs)))
    monkeypatch.setattr(backend, "begin_step", recording)
    assert engine.generate(tiny_prompts, SamplingParams(max_tokens=30)) == refs
    if gather_min_queries == 4:
        assert (True, True) in paths  # a step with both a kernel and a gathered part


def test_a_decode_beside_a_long_prefill_equals_the_reference(tiny_model, tiny_prompts, monkeypatch):
    # by default a 64-query prefill chunk and the decodes beside it are one kernel call per layer, nothing gathered
    engine = make_engine(tiny_model, 64, max_prefill_tokens=64)
    backend = engine.runner.backend
    assert backend.gather_min_queries is attention.GATHER_MIN_QUERIES is None
    steps = []
    begin = backend.begin_step

    def recording(meta):
        begin(meta)
        steps.append((sorted(b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:])),
                      backend._paged is not None and len(backend._paged.query_lens) == meta.num_seqs,
                      bool(backend._seqs)))
    monkeypatch.setattr(backend, "begin_step", recording)
    long_prompt = (tiny_prompts[2] * 3)[:100]
    engine.add_request("short", tiny_prompts[0], SamplingParams(max_tokens=12))
    outputs: dict[str, list[int]] = {}
    for step in range(40):
        if step == 3:
            engine.add_request("long", long_prompt, SamplingParams(max_tokens=6))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            break
    assert outputs == {"short": reference(tiny_model.model, tiny_prompts[0], 12),
                       "long": reference(tiny_model.model, long_prompt, 6)}
    assert ([1, 64], True, False) in steps  # a decode and a 64-query chunk, all through the kernel
    assert all(kernel and not gathered for _, kernel, gathered in steps)
