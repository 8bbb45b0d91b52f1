"""The device KV arena: bytes per block against the formula, what `gather` returns against the
quantizers applied directly, KIVI's open block kept exact until it fills."""

import math

import pytest
import torch

from kvtier.blocks import KVLayout
from kvtier.codecs import quant
from kvtier.engine.arena import ARENA_CODECS, arena_block_bytes, make_arena
from kvtier.engine.attention import SeqSlice

L, H, T, D = 2, 3, 8, 64
LAYOUT = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float32", block_tokens=T)


def expected_block_bytes(codec: str) -> int:
    """Written out from the formats' definitions, per layer: K and V codes + their scales."""
    elems = H * T * D
    per_layer = {
        "raw": 2 * elems * 4,
        "fp8": 2 * (elems + 4 * H * T),                      # e4m3 codes + an fp32 scale per token and head
        "int8": 2 * (elems + 2 * 2 * H * T),                 # codes + fp16 scale and min per token and head
        "int4": elems // 2 + 2 * 2 * H * D + elems // 2 + 2 * 2 * H * T * math.ceil(D / 64),
        "int2": elems // 4 + 2 * 2 * H * D + elems // 4 + 2 * 2 * H * T * math.ceil(D / 64),
    }[codec]
    return L * per_layer


@pytest.mark.parametrize("codec", ARENA_CODECS)
def test_block_bytes_match_the_formula_and_the_allocation(codec):
    assert arena_block_bytes(LAYOUT, codec) == expected_block_bytes(codec)
    arena = make_arena(LAYOUT, 10 * LAYOUT.block_bytes, codec, max_open_blocks=2)
    tensors = [arena.k_cache, arena.v_cache] if codec == "raw" else list(arena.parts.values())
    assert sum(t.nbytes for t in tensors) == arena.num_blocks * arena.block_bytes
    reserved = 2 * LAYOUT.block_bytes if codec in ("int4", "int2") else 0
    assert arena.num_blocks == (10 * LAYOUT.block_bytes - reserved) // expected_block_bytes(codec)
    assert arena.reserved_bytes == reserved


def test_a_budget_holds_more_tokens_quantized():
    # the same bytes hold ~3.8x more blocks at int8 (vs fp32) and ~5x at int4 (with 8-token blocks the
    # keys' per-channel scales cost as much as their codes; one open block is reserved)
    budget = 64 * LAYOUT.block_bytes
    counts = {c: make_arena(LAYOUT, budget, c, max_open_blocks=1).num_blocks for c in ARENA_CODECS}
    assert counts["raw"] == 64
    assert counts["int8"] >= 3.5 * 64 and counts["fp8"] >= 3.5 * 64
    assert counts["int4"] >= 5 * 64 and counts["int4"] > counts["int8"] and counts["int2"] > counts["int4"]


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, D, generator=gen) * torch.linspace(0.1, 8, D)  # channel outliers, as keys have
    v = torch.randn(n, H, D, generator=gen)
    return k, v


def _write(arena, layer: int, block_table: list[int], start: int, keys, values) -> None:
    pos = torch.arange(start, start + keys.shape[0])
    arena.write(layer, torch.tensor(block_table)[pos // T], pos % T, keys, values)


def _gather(arena, layer: int, block_table: list[int], context: int):
    """Keys and values [H, context, D] that the last token (one query) attends to."""
    table = torch.tensor(block_table[:-(-context // T)])
    [(lo, hi, k, v)] = arena.gather(layer, SeqSlice(0, 1, arena.context_index(table, context), context))
    assert (lo, hi) == (0, 1)
    return k, v


def _per_token_reference(codec: str, x: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] quantized one token at a time, as the arena's writes do."""
    rows = []
    for token in x:
        q = quant.quantize_fp8(token[None]) if codec == "fp8" else quant.quantize_int8(token[None])
        rows.append(quant.dequantize(q)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("codec", ["fp8", "int8"])
def test_per_token_codecs_store_each_token_as_the_quantizer_does(codec):
    arena = make_arena(LAYOUT, 8 * LAYOUT.block_bytes, codec)
    table = [5, 2, 7]
    k, v = _tokens(20, seed=0)
    for layer in range(L):  # a prefill chunk of 13, then decode steps of one token
        _write(arena, layer, table, 0, k[:13], v[:13])
    for p in range(13, 20):
        for layer in range(L):
            _write(arena, layer, table, p, k[p:p + 1], v[p:p + 1])
        arena.end_step()
    gk, gv = _gather(arena, 1, table, 20)
    assert gk.shape == (H, 20, D)
    assert torch.equal(gk, _per_token_reference(codec, k).transpose(0, 1))
    assert torch.equal(gv, _per_token_reference(codec, v).transpose(0, 1))
    assert (gk - k.transpose(0, 1)).abs().max() > 0  # lossy, really quantized


@pytest.mark.parametrize("codec", ["int4", "int2"])
def test_kivi_keeps_the_open_block_exact_and_seals_full_blocks(codec):
    bits = int(codec[3:])
    arena = make_arena(LAYOUT, 8 * LAYOUT.block_bytes, codec, max_open_blocks=1)
    table = [3, 0, 6]
    k, v = _tokens(21, seed=1)
    for p in range(21):  # one token per step, all layers
        for layer in range(L):
            _write(arena, layer, table, p, k[p:p + 1], v[p:p + 1])
        if p == T - 1:  # the token that fills block 0 still attends to it exactly (at the layer being
            # computed: earlier layers' exact copies are already dropped); the block is sealed
            gk, _ = _gather(arena, L - 1, table, T)
            assert torch.equal(gk, k[:T].transpose(0, 1))
            assert arena.staging[3][0] is None
            sealed_keys = arena.block_tensor(3)[0, 0]
            assert torch.equal(sealed_keys, quant.dequantize(quant.quantize_kivi_keys(k[:T].transpose(0, 1), bits, T)))
        arena.end_step()
    gk, gv = _gather(arena, 0, table, 21)
    for b in range(2):  # two full blocks: keys per channel over the block, values per token
        kb, vb = k[b * T:(b + 1) * T].transpose(0, 1), v[b * T:(b + 1) * T].transpose(0, 1)
        assert torch.equal(gk[:, b * T:(b + 1) * T], quant.dequantize(quant.quantize_kivi_keys(kb, bits, T)))
        assert torch.equal(gv[:, b * T:(b + 1) * T], quant.dequantize(quant.quantize_kivi_values(vb, bits, 64)))
    # the open block (5 of 8 tokens) is the residual: exact
    assert torch.equal(gk[:, 2 * T:], k[2 * T:].transpose(0, 1))
    assert torch.equal(gv[:, 2 * T:], v[2 * T:].transpose(0, 1))
    assert set(arena.staging) == {6}


def test_kivi_prefill_sees_the_same_kv_however_it_is_chunked():
    """A chunk spanning blocks: each query's own block exact, earlier blocks dequantized — what
    token-by-token decoding gives."""
    k, v = _tokens(20, seed=6)
    chunked = make_arena(LAYOUT, 8 * LAYOUT.block_bytes, "int4", max_open_blocks=1)
    _write(chunked, 0, [0, 1, 2], 0, k, v)
    table = torch.tensor([0, 1, 2])
    groups = chunked.gather(0, SeqSlice(0, 20, table, 20))
    assert [(lo, hi) for lo, hi, _, _ in groups] == [(0, 8), (8, 16), (16, 20)]
    # the transient cost of the chunk: blocks it filled keep an exact copy of the current layer only
    _write(chunked, 1, [0, 1, 2], 0, k, v)
    assert [x is None for x in chunked.staging[0]] == [True, False] == [x is None for x in chunked.staging[1]]
    assert all(x is not None for x in chunked.staging[2])  # the open block: every layer, until it fills
    chunked.end_step()
    assert set(chunked.staging) == {2}
    stepped = make_arena(LAYOUT, 8 * LAYOUT.block_bytes, "int4", max_open_blocks=1)
    for p in range(20):
        _write(stepped, 0, [0, 1, 2], p, k[p:p + 1], v[p:p + 1])
        if p + 1 in (8, 16, 20):  # the last query of each group attends to exactly this
            sk, sv = _gather(stepped, 0, [0, 1, 2], p + 1)
            _, _, ck, cv = groups[[8, 16, 20].index(p + 1)]
            assert torch.equal(sk, ck) and torch.equal(sv, cv)
        stepped.end_step()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_planned_step_gathers_what_each_sequence_alone_would(codec):
    """One decode per sequence; b and c share a's first block (a prefix), so their blocks are not
    consecutive in the step's decoded union."""
    arena = make_arena(LAYOUT, 16 * LAYOUT.block_bytes, codec, max_open_blocks=3)
    tables = {"a": [0, 1, 2], "b": [0, 3, 4], "c": [5, 0, 6]}
    k, v = _tokens(24, seed=7)
    for layer in range(L):
        for table in tables.values():
            _write(arena, layer, table, 0, k[:20], v[:20])
    arena.end_step()
    alone = {name: _gather(arena, 1, table, 20) for name, table in tables.items()}
    seqs = {name: SeqSlice(0, 1, torch.tensor(table), 20) for name, table in tables.items()}
    arena.begin_step(list(seqs.values()))
    for name, seq in seqs.items():
        [(_, _, gk, gv)] = arena.gather(1, seq)
        assert torch.equal(gk, alone[name][0]) and torch.equal(gv, alone[name][1])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_raw_block_is_written_over_all_its_layers_in_one_copy_per_thread(threads):
    from kvtier.transfer.copies import CopyGroup

    arena = make_arena(LAYOUT, 8 * LAYOUT.block_bytes, "raw", max_open_blocks=1)
    block = torch.randn(LAYOUT.block_shape, generator=torch.Generator().manual_seed(threads))
    with CopyGroup(threads) as copies:
        arena.write_block(5, block, copies)
    assert copies.num_copies == (0 if threads == 1 else 2 * min(threads, LAYOUT.num_layers))  # 1: copied now
    assert torch.equal(arena.block_tensor(5), block)
    assert not arena.block_tensor(4).any() and not arena.block_tensor(6).any()


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4"])
def test_tier_blocks_round_trip_through_the_quantizer(codec):
    arena = make_arena(LAYOUT, 8 * LAYOUT.block_bytes, codec, max_open_blocks=1)
    gen = torch.Generator().manual_seed(4)
    block = torch.randn(LAYOUT.block_shape, generator=gen)
    arena.write_block(3, block)
    out = arena.block_tensor(3)
    assert out.shape == LAYOUT.block_shape and out.dtype == torch.float32
    err = (out - block).abs()
    assert err.max() > 0
    if codec == "fp8":  # 3 mantissa bits
        assert bool((err <= 2**-4 * block.abs() + 1e-3).all())
    else:  # half a step of 255 (int8, per token) or 15 (int4, per channel over 8 tokens) levels of a ~8-wide range
        assert err.max() < (0.02 if codec == "int8" else 0.4)
    # what attention sees of that block is exactly what goes down to the tiers
    gk, gv = _gather(arena, 1, [3], T)
    assert torch.equal(gk, out[1, 0]) and torch.equal(gv, out[1, 1])


@pytest.mark.parametrize("codec", ["fp8", "int8", "int4", "int2"])
def test_requantizing_a_dequantized_block_gives_it_back(codec):
    # what a tier sends back (the dequantized block) is stored again as the same codes: fp16 mins are
    # rounded down and scales up, so the dequantized extremes land on codes 0 and 2^b - 1 again
    arena = make_arena(LAYOUT, 8 * LAYOUT.block_bytes, codec, max_open_blocks=1)
    for seed in range(5):
        block = torch.randn(LAYOUT.block_shape, generator=torch.Generator().manual_seed(seed)) * 3
        arena.write_block(0, block)
        once = arena.block_tensor(0)
        arena.write_block(1, once)
        assert torch.equal(arena.block_tensor(1), once)


def test_kivi_with_a_head_dim_that_is_not_a_multiple_of_the_value_group():
    # head_dim 96 (Phi-2 / Phi-3-mini): values per token in groups of 64 channels, the last one padded
    layout = KVLayout(num_layers=1, num_kv_heads=2, head_dim=96, dtype="float32", block_tokens=4)
    arena = make_arena(layout, 8 * layout.block_bytes, "int4", max_open_blocks=1)
    assert sum(t.nbytes for t in arena.parts.values()) == arena.num_blocks * arena.block_bytes
    gen = torch.Generator().manual_seed(8)
    k, v = torch.randn(6, 2, 96, generator=gen), torch.randn(6, 2, 96, generator=gen)
    pos = torch.arange(6)
    arena.write(0, torch.tensor([3, 3, 3, 3, 5, 5]), pos % 4, k, v)
    table = torch.tensor([3, 5])
    [(_, _, gk, gv)] = arena.gather(0, SeqSlice(0, 1, table, 6))
    assert torch.equal(gv[:, :4], quant.dequantize(quant.quantize_kivi_values(v[:4].transpose(0, 1), 4, 64)))
    assert torch.equal(gk[:, :4], quant.dequantize(quant.quantize_kivi_keys(k[:4].transpose(0, 1), 4, 4)))
    assert torch.equal(gk[:, 4:], k[4:].transpose(0, 1))


def test_a_step_that_failed_half_way_does_not_seal_the_next_owners_block():
    arena = make_arena(LAYOUT, 8 * LAYOUT.block_bytes, "int4", max_open_blocks=1)
    k, v = _tokens(12, seed=9)
    arena.begin_step([])
    _write(arena, 0, [0], 0, k[:T], v[:T])  # fills block 0 at layer 0; the forward then fails: no end_step
    for p in range(3):  # block 0 goes to a new sequence, which writes it token by token over two steps
        arena.begin_step([])
        for layer in range(L):
            _write(arena, layer, [0], p, k[T + p:T + p + 1], v[T + p:T + p + 1])
        arena.end_step()
    gk, gv = _gather(arena, 1, [0], 3)
    assert torch.equal(gk, k[T:T + 3].transpose(0, 1)) and torch.equal(gv, v[T:T + 3].transpose(0, 1))


def test_unknown_codec_and_nan_are_refused():
    with pytest.raises(ValueError, match="int3"):
        make_arena(LAYOUT, LAYOUT.block_bytes, "int3")
    with pytest.raises(ValueError, match="max_num_seqs"):  # the open blocks alone fill the budget
        make_arena(LAYOUT, 4 * LAYOUT.block_bytes, "int4", max_open_blocks=4)
    arena = make_arena(LAYOUT, 4 * LAYOUT.block_bytes, "int8")
    k, v = _tokens(1, seed=5)
    k[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        _write(arena, 0, [0], 0, k, v)
