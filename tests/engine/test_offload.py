"""Contexts larger than the device (issue 18): an offloaded request keeps sinks + a recent window on
the device and its middle blocks pinned in the DRAM tier; exact mode == everything on the device.
Tests with a `cuda` id run the CUDA path (side stream, pinned slots) and are skipped without a GPU;
`make gpu-check` runs them (`-k cuda`)."""

import sys
import threading
from pathlib import Path

import pytest
import torch

from kvtier import models
from kvtier.codecs import get_codec
from kvtier.engine import EngineConfig, LLMEngine, SamplingParams
from kvtier.engine.engine import ContextLengthError, HostRoomError
from kvtier.offload.attend import attend, merge
from kvtier.offload.attention import OffloadAttention, SeqOffload
from kvtier.offload.config import OffloadMode, parse_offload
from kvtier.offload.fetch import FetchArea
from kvtier.offload.pages import page_summary, quest_scores, select_blocks, select_pages
from kvtier.offload.stats import OffloadStats
from kvtier.engine.scheduler import SchedulerOutput
from kvtier.tiers.manager import build_manager

sys.path.insert(0, str(Path(__file__).parent))
from engine_support import reference  # noqa: E402

BLOCK = 8
NEW = 24
DEVICE_BLOCKS = 12  # 96 tokens of budget, half of it the fetch area: every request below is longer than 48


@pytest.fixture(scope="module")
def long_prompts():
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (61, 75, 90)]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=cuda)]
ON_DEVICES = pytest.mark.parametrize("loaded", DEVICES, indirect=True)  # the engine on the CPU, and on CUDA


@pytest.fixture(scope="module")
def refs(tiny_model, long_prompts):
    return [reference(tiny_model.model, p, NEW) for p in long_prompts]


@pytest.fixture(scope="module")
def cuda_tiny_model():
    return models.load("tiny", device="cuda")


@pytest.fixture(scope="module")
def loaded(request):
    """The tiny model on the device of the test's id (ON_DEVICES)."""
    return request.getfixturevalue("tiny_model" if request.param == "cpu" else "cuda_tiny_model")


@pytest.fixture(scope="module")
def loaded_refs(request, loaded, long_prompts):
    """Greedy `generate` on that model, on its own device."""
    if loaded.model.device.type == "cpu":
        return request.getfixturevalue("refs")
    return [reference(loaded.model, p, NEW) for p in long_prompts]


def make(model, mode="exact", dram="64MiB", device_blocks=DEVICE_BLOCKS, **kwargs):
    layout = model.kv_layout(BLOCK)
    manager = build_manager([f"dram:{dram}"], slot_bytes=get_codec("raw").max_encoded_bytes(layout))
    kwargs.setdefault("max_prefill_tokens", 16)
    kwargs.setdefault("offload_fetch_blocks", 3)
    config = EngineConfig(device_kv_budget_bytes=device_blocks * layout.block_bytes, block_tokens=BLOCK,
                          kv_offload=mode, **kwargs)
    return LLMEngine(model, config, manager), manager


def drain(engine):
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


@ON_DEVICES
@pytest.mark.parametrize("fetch_blocks, device_blocks", [
    (3, DEVICE_BLOCKS),  # more host blocks than half the fetch area: pieces merged by log-sum-exp
    (12, 20),            # all of them fit: host blocks + window in one SDPA call (5 device blocks)
])
def test_exact_offload_equals_everything_on_the_device(loaded, long_prompts, loaded_refs, fetch_blocks,
                                                       device_blocks):
    engine, manager = make(loaded, offload_fetch_blocks=fetch_blocks, device_blocks=device_blocks)
    budget = engine.config.device_kv_budget_bytes
    assert engine.device_kv_bytes <= budget  # arena + fetch area, allocated once
    for i, prompt in enumerate(long_prompts):  # all at once: they share the device window and fetch area
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=NEW))
    outputs = drain(engine)
    window_bytes = (1 + 2) * engine.arena.block_bytes
    for i, ref in enumerate(loaded_refs):
        assert [t for o in outputs[str(i)] for t in o.new_token_ids] == ref
        stats = outputs[str(i)][-1].offload
        assert stats is not None and stats.mode == "exact"
        assert 0 < stats.peak_device_kv_bytes <= window_bytes
        # every host block was fetched for every layer of every decode step
        n_tokens = len(long_prompts[i]) + NEW
        assert stats.host_kv_bytes == (-(-n_tokens // BLOCK) - 3) * engine.layout.block_bytes or \
            stats.host_kv_bytes == (n_tokens // BLOCK - 3) * engine.layout.block_bytes
    host = manager.tiers[0]
    assert host.num_leased() == 0 and engine.host_blocks_reserved == 0
    assert engine.stats().num_device_blocks_used == 0
    # the fetch area's own copies (prefill chunks; CUDA: decodes too, timed by its events) and, on the CPU, the
    # decodes' reads in place: every byte the requests fetched
    in_place = engine.offload_attention.in_place_bytes
    assert engine.fetch.copied_bytes + in_place == sum(outputs[str(i)][-1].offload.fetched_bytes
                                                       for i in range(len(loaded_refs)))
    assert engine.fetch.copy_seconds > 0 and (in_place > 0) == (loaded.model.device.type == "cpu")
    engine.close()
    manager.close()


@ON_DEVICES
@pytest.mark.parametrize("page_tokens", [BLOCK, 2])  # a page is the block; pages of 2 tokens
def test_sparse_with_every_page_in_budget_is_exact(loaded, long_prompts, loaded_refs, page_tokens):
    """A sparse request whose budget covers every page: summaries kept, blocks fetched as exact."""
    engine, manager = make(loaded, "sparse:1000", offload_page_tokens=page_tokens)
    engine.add_request("a", long_prompts[2], SamplingParams(max_tokens=NEW))
    outputs = drain(engine)["a"]
    assert [t for o in outputs for t in o.new_token_ids] == loaded_refs[2]
    layout = engine.layout  # summaries: 3 x D fp32 values (key min, max, mean) per layer, page and KV head of every block
    per_block = layout.num_layers * (BLOCK // page_tokens) * layout.num_kv_heads * 3 * layout.head_dim * 4
    assert outputs[-1].offload.summary_bytes == -(-(len(long_prompts[2]) + NEW) // BLOCK) * per_block
    engine.close()
    manager.close()


@ON_DEVICES
@pytest.mark.parametrize("page_tokens", [BLOCK, 2])
def test_sparse_budget_fetches_its_fraction(loaded, long_prompts, page_tokens):
    per_token = {}
    for mode in ("exact", "sparse:1/4"):
        engine, manager = make(loaded, mode, offload_fetch_blocks=4, offload_page_tokens=page_tokens)
        engine.add_request("a", long_prompts[2], SamplingParams(max_tokens=NEW, ignore_eos=True))
        stats = drain(engine)["a"][-1].offload
        assert stats.num_decode_tokens == NEW - 1
        per_token[mode] = stats.fetched_bytes_per_token
        engine.close()
        manager.close()
    # per decode step: floor(n / 4) of n host pages (at least one): never more than 1/4 of exact's bytes
    assert 0 < per_token["sparse:1/4"] <= per_token["exact"] / 4


@pytest.mark.parametrize("mode", ["exact", "sparse:1000"])
def test_offloaded_prefix_is_reused_in_place(tiny_model, long_prompts, refs, mode):
    """A second long request with the same prompt, on a fresh device (a second engine on the same tiers):
    its sink block is loaded from DRAM, its middle blocks are pinned where DRAM holds them (no copy),
    only the prompt's last block is computed, and its tokens equal everything on the device."""
    engine, manager = make(tiny_model, mode, synchronous_transfers=True)
    assert engine.generate([long_prompts[2]], SamplingParams(max_tokens=NEW)) == [refs[2]]
    engine.close()
    second = LLMEngine(tiny_model, engine.config, manager)
    leased = []
    lease = manager.lease_in_place
    manager.lease_in_place = lambda items, **kw: leased.extend(d for _, d in items) or lease(items, **kw)  # None: in place
    second.add_request("b", long_prompts[2], SamplingParams(max_tokens=NEW))
    outputs = drain(second)["b"]
    assert [t for o in outputs for t in o.new_token_ids] == refs[2]
    cached = (len(long_prompts[2]) - 1) // BLOCK * BLOCK  # every full block before the last token
    assert outputs[-1].num_cached_tokens == cached
    assert outputs[-1].cached_tokens_by_tier == {"dram": cached}
    assert second.num_tokens_computed == len(long_prompts[2]) - cached + NEW - 1
    num_middle = cached // BLOCK - 1  # after the sink block
    assert leased[:num_middle] == [None] * num_middle  # the reused blocks: pinned where they are
    assert manager.tiers[0].num_leased() == 0 and second.host_blocks_reserved == 0
    second.close()
    manager.close()


def ssd_engines(tiny_model, long_prompts, refs, tmp_path):
    """Prompt 2 computed by a first engine on DRAM + SSD; a second process's manager (new DRAM, the same
    SSD directory), its engine with the transfer worker on its own thread."""
    layout = tiny_model.kv_layout(BLOCK)
    specs = ["dram:64MiB", f"ssd:{tmp_path}:64MiB"]
    slot = get_codec("raw").max_encoded_bytes(layout)
    config = EngineConfig(device_kv_budget_bytes=DEVICE_BLOCKS * layout.block_bytes, block_tokens=BLOCK,
                          kv_offload="exact", max_prefill_tokens=16, offload_fetch_blocks=3, synchronous_transfers=True)
    manager = build_manager(specs, slot_bytes=slot)
    engine = LLMEngine(tiny_model, config, manager)
    assert engine.generate([long_prompts[2]], SamplingParams(max_tokens=NEW)) == [refs[2]]
    engine.close()
    manager.flush()
    manager.close()
    manager = build_manager(specs, slot_bytes=slot)
    config.synchronous_transfers = False
    return LLMEngine(tiny_model, config, manager), manager


def test_offloaded_prefix_from_the_ssd_tier_is_reused(tiny_model, long_prompts, refs, tmp_path):
    """A second process (new DRAM, the same SSD directory): the sink block and the middle blocks are found
    by one lookup; the transfer worker loads the sink block into the device and reads the middle blocks
    once (payload checksums) into DRAM slots, pinned there — the step thread never reads the SSD — and
    they are not written back down."""
    second, manager = ssd_engines(tiny_model, long_prompts, refs, tmp_path)
    ssd = manager.tiers[1]
    matches, reads_on_step_thread, written_down = [], [], set()
    match = manager.match
    manager.match = lambda keys, **kw: matches.append(len(keys)) or match(keys, **kw)
    for name in ("lease_many", "get_many"):
        read = getattr(ssd, name)
        setattr(ssd, name, lambda keys, read=read: reads_on_step_thread.append(
            threading.current_thread() is threading.main_thread()) or read(keys))
    for name in ("contains_many", "put_many"):
        write = getattr(ssd, name)
        setattr(ssd, name, lambda items, write=write: written_down.update(
            i if isinstance(i, bytes) else i[0] for i in items) or write(items))
    second.add_request("b", long_prompts[2], SamplingParams(max_tokens=NEW))
    outputs = drain(second)["b"]
    manager.flush()
    assert [t for o in outputs for t in o.new_token_ids] == refs[2]
    cached = (len(long_prompts[2]) - 1) // BLOCK * BLOCK
    assert outputs[-1].cached_tokens_by_tier == {"ssd": cached}
    assert second.num_tokens_computed == len(long_prompts[2]) - cached + NEW - 1
    assert matches == [len(long_prompts[2]) // BLOCK]  # sink and middle blocks: one lookup, no re-match
    stats = second.transfer.stats  # and one load: the sink block into the device, the rest into DRAM slots
    assert stats.num_loads == 1 and stats.num_blocks_loaded == cached // BLOCK
    assert reads_on_step_thread and not any(reads_on_step_thread)
    from kvtier.blocks import block_keys
    prefix_keys = set(block_keys(second.scheduler.space, long_prompts[2][:cached]))
    assert not prefix_keys & written_down  # read from the SSD: nothing to write back there
    assert manager.tiers[0].num_leased() == 0 and len(manager.tiers[0]._pins) == 0
    second.close()
    manager.close()


def test_a_request_aborted_while_its_host_blocks_load_gives_them_back(tiny_model, long_prompts, refs, tmp_path):
    second, manager = ssd_engines(tiny_model, long_prompts, refs, tmp_path)
    ssd, go = manager.tiers[1], threading.Event()
    lease = ssd.lease_many
    ssd.lease_many = lambda keys: go.wait(30) and lease(keys)
    second.add_request("b", long_prompts[2], SamplingParams(max_tokens=NEW))
    second.step()
    assert second.stats().num_waiting_for_kv == 1
    reserved = second.host_blocks_reserved
    assert second.abort_request("b")
    # until the load is back it may still pin host slots: its room stays taken, its id too
    assert second.host_blocks_reserved == reserved > 0
    with pytest.raises(ValueError, match="already in the engine"):
        second.add_request("b", long_prompts[2], SamplingParams(max_tokens=NEW))
    go.set()
    assert second.has_unfinished_requests()  # until the load is back: it still holds blocks
    while second.has_unfinished_requests():
        second.step()
    host = manager.tiers[0]
    assert host.num_leased() == 0 and len(host._pins) == 0 and second.host_pool.num_pinned == 0
    assert second.stats().num_device_blocks_used == 0 and second.host_blocks_reserved == 0
    second.close()
    manager.close()


def test_offloaded_prefix_with_a_bad_sink_block_is_computed(tiny_model, long_prompts, refs):
    """The sink block comes back bad: the host blocks after it are not used (released), the prompt is
    computed, the tokens are still exact."""
    engine, manager = make(tiny_model, synchronous_transfers=True)
    assert engine.generate([long_prompts[2]], SamplingParams(max_tokens=NEW)) == [refs[2]]
    engine.close()
    host = manager.tiers[0]
    from kvtier.blocks import block_keys
    sink_key = block_keys(engine.scheduler.space, long_prompts[2][:BLOCK])[0]
    host._arena_np[host._key_to_slot[sink_key] * host.slot_bytes + 20] ^= 0xFF  # its header
    second = LLMEngine(tiny_model, engine.config, manager)
    second.add_request("b", long_prompts[2], SamplingParams(max_tokens=NEW))
    outputs = drain(second)["b"]
    assert [t for o in outputs for t in o.new_token_ids] == refs[2]
    assert outputs[-1].num_cached_tokens == 0
    assert second.num_tokens_computed == len(long_prompts[2]) + NEW - 1
    assert host.stats.corrupt > 0 and host.num_leased() == 0 and second.host_blocks_reserved == 0
    assert len(host._pins) == 0  # the middle blocks' lookup pins ended too (their load never ran)
    second.close()
    manager.close()


def test_offloaded_prefix_with_part_of_its_sinks_on_the_device(tiny_model, long_prompts, refs):
    """Two sink blocks, the first cached on the device (a short request computed it), the second and the
    middle blocks in DRAM: one lookup from the second block on, split between the device and host memory."""
    engine, manager = make(tiny_model, synchronous_transfers=True, offload_sink_blocks=2)
    assert engine.generate([long_prompts[2]], SamplingParams(max_tokens=NEW)) == [refs[2]]
    engine.close()
    second = LLMEngine(tiny_model, engine.config, manager)
    second.generate([long_prompts[2][:BLOCK + 4]], SamplingParams(max_tokens=1))  # block 0 on the device
    matches = []
    match = manager.match
    manager.match = lambda keys, **kw: matches.append(len(keys)) or match(keys, **kw)
    second.add_request("b", long_prompts[2], SamplingParams(max_tokens=NEW))
    outputs = drain(second)["b"]
    assert [t for o in outputs for t in o.new_token_ids] == refs[2]
    cached = (len(long_prompts[2]) - 1) // BLOCK * BLOCK
    assert outputs[-1].cached_tokens_by_tier == {"device": BLOCK, "dram": cached - BLOCK}
    assert matches == [len(long_prompts[2]) // BLOCK - 1]
    host = manager.tiers[0]
    assert host.num_leased() == 0 and len(host._pins) == 0 and second.host_blocks_reserved == 0
    second.close()
    manager.close()


def test_host_blocks_that_cannot_be_taken_are_given_back_and_computed(tiny_model, long_prompts, refs):
    """Taking a load's host blocks fails on the step thread (their sparse summaries: device memory): the
    slots go back, the sequence computes from after its sink block, its tokens are still exact."""
    engine, manager = make(tiny_model, "sparse:1000", synchronous_transfers=True)
    assert engine.generate([long_prompts[2]], SamplingParams(max_tokens=NEW)) == [refs[2]]
    engine.close()
    second = LLMEngine(tiny_model, engine.config, manager)

    def fail(seq, pinned):
        raise RuntimeError("out of device memory")

    second._take_host_blocks = fail
    second.add_request("b", long_prompts[2], SamplingParams(max_tokens=NEW))
    outputs = drain(second)["b"]
    assert [t for o in outputs for t in o.new_token_ids] == refs[2]
    assert outputs[-1].num_cached_tokens == BLOCK  # the sink block only
    assert second.num_tokens_computed == len(long_prompts[2]) - BLOCK + NEW - 1
    host = manager.tiers[0]
    assert host.num_leased() == 0 and len(host._pins) == 0 and second.host_blocks_reserved == 0
    second.close()
    manager.close()


def test_abort_frees_host_blocks(tiny_model, long_prompts):
    engine, manager = make(tiny_model)
    engine.add_request("a", long_prompts[2], SamplingParams(max_tokens=NEW))
    while not engine._seqs["a"].host.slots:
        engine.step()
    assert manager.tiers[0].num_leased() > 0 and engine.host_blocks_reserved > 0
    assert engine.host_pool.num_pinned == len(engine._seqs["a"].host.slots) > 0  # the pool counts its pins
    assert engine.abort_request("a")
    assert manager.tiers[0].num_leased() == 0 and engine.host_blocks_reserved == 0
    assert engine.host_pool.num_pinned == 0
    engine.close()
    manager.close()


def test_preempted_offloaded_request_recomputes_exactly(tiny_model, long_prompts, refs):
    engine, manager = make(tiny_model)
    engine.add_request("a", long_prompts[1], SamplingParams(max_tokens=NEW))
    got = []
    while len(got) < 5:
        got += [t for o in engine.step() for t in o.new_token_ids]
    seq = engine._seqs["a"]
    assert seq.host.slots
    engine.scheduler._preempt(seq, SchedulerOutput())  # as when a decode finds no block
    engine._unpin()
    assert manager.tiers[0].num_leased() == 0 and not seq.host.slots and engine.host_pool.num_pinned == 0
    got += [t for outs in drain(engine).values() for o in outs for t in o.new_token_ids]
    assert got == refs[1]
    assert engine.host_blocks_reserved == 0
    engine.close()
    manager.close()


def test_host_room_exhausted_refuses_the_new_request_only(tiny_model, long_prompts, refs):
    layout = tiny_model.kv_layout(BLOCK)
    slot = get_codec("raw").max_encoded_bytes(layout)
    engine, manager = make(tiny_model, dram=str(10 * slot))  # 10 host blocks
    engine.add_request("a", long_prompts[1], SamplingParams(max_tokens=NEW))  # needs 10 - 3 = 9... of them
    with pytest.raises(HostRoomError) as exc:
        engine.check_request(len(long_prompts[0]), NEW)
    assert exc.value.ever and "retry later" in str(exc.value)
    with pytest.raises(HostRoomError) as exc:
        engine.add_request("b", long_prompts[0], SamplingParams(max_tokens=NEW))
    assert "b" not in engine.request_ids()
    with pytest.raises(HostRoomError) as exc:  # more than the DRAM tier holds at all
        engine.check_request(200, 200)
    assert not exc.value.ever
    outputs = drain(engine)["a"]
    assert [t for o in outputs for t in o.new_token_ids] == refs[1]
    engine.check_request(len(long_prompts[0]), NEW)  # room again
    engine.close()
    manager.close()


def test_offload_off_refuses_what_the_device_cannot_hold(tiny_model, long_prompts):
    engine, manager = make(tiny_model, "off")
    with pytest.raises(ContextLengthError, match="--kv-offload"):
        engine.check_request(len(long_prompts[2]), NEW)
    with pytest.raises(ValueError, match="offload off"):
        engine.check_request(10, 5, kv_offload="exact")
    engine.close()
    manager.close()
    engine, manager = make(tiny_model, "exact")
    with pytest.raises(ContextLengthError):  # a request may ask to stay on the device
        engine.check_request(len(long_prompts[2]), NEW, kv_offload="off")
    engine.check_request(len(long_prompts[2]), NEW)
    engine.close()
    manager.close()


def test_per_request_sparse_on_an_exact_engine(tiny_model, long_prompts):
    engine, manager = make(tiny_model, "exact", offload_fetch_blocks=4)
    engine.add_request("a", long_prompts[2], SamplingParams(max_tokens=4, kv_offload="sparse:2"))
    stats = drain(engine)["a"][-1].offload
    assert stats.mode == "sparse:2" and stats.summary_bytes > 0
    engine.close()
    manager.close()


def test_a_dram_block_with_a_bad_header_is_replaced_not_used(tiny_model, long_prompts, refs):
    engine, manager = make(tiny_model, synchronous_transfers=True)
    assert engine.generate([long_prompts[1]], SamplingParams(max_tokens=NEW)) == [refs[1]]
    host = manager.tiers[0]
    for slot in list(host._key_to_slot.values()):  # every block it wrote through: header byte flipped
        host._arena_np[slot * host.slot_bytes + 20] ^= 0xFF
    assert engine.generate([long_prompts[1]], SamplingParams(max_tokens=NEW)) == [refs[1]]
    assert host.stats.corrupt > 0 and host.num_leased() == 0
    engine.close()
    manager.close()


def test_config_refusals(tiny_model):
    layout = tiny_model.kv_layout(BLOCK)
    with pytest.raises(ValueError, match="raw"):
        EngineConfig(kv_offload="exact", kv_codec="int8")
    with pytest.raises(ValueError, match="sparse:BUDGET"):
        EngineConfig(kv_offload="sometimes")
    with pytest.raises(ValueError, match="DRAM tier"):
        LLMEngine(tiny_model, EngineConfig(device_kv_budget_bytes=8 * layout.block_bytes, block_tokens=BLOCK,
                                           kv_offload="exact"))
    with pytest.raises(ValueError, match="fraction"):
        parse_offload("sparse:1.5")
    assert parse_offload("sparse:1/8") == OffloadMode("sparse", 0.125) and str(parse_offload("sparse:0.125")) == "sparse:1/8"
    assert parse_offload("off") is None and OffloadMode("sparse", 0.125).num_fetched(20) == 2
    assert OffloadMode("sparse", 0.125).num_fetched(125) == 15 and OffloadMode("sparse", 0.125).num_fetched(5) == 1
    with pytest.raises(ValueError, match="must divide block_tokens"):
        EngineConfig(block_tokens=BLOCK, kv_offload="sparse:1/8", offload_page_tokens=3)
    with pytest.raises(ValueError, match="must be positive"):
        EngineConfig(offload_page_tokens=0)
    assert EngineConfig(block_tokens=BLOCK, offload_page_tokens=64).page_tokens == BLOCK  # at most the block
    assert EngineConfig(block_tokens=256, offload_page_tokens=64).page_tokens == 64
    EngineConfig(block_tokens=BLOCK, offload_page_tokens=3)  # offload off: pages unused


def test_page_selection_with_block_sized_pages_is_the_block_selection():
    """P = T: one page per block, summaries, scores and picks exactly as when blocks were the unit."""
    gen = torch.Generator().manual_seed(1)
    n, l, h, g, t, d = 9, 2, 3, 2, 8, 16
    k_blocks = torch.randn(n, l, h, t, d, generator=gen)
    q = torch.randn(h, g, d, generator=gen)
    summaries = torch.stack([page_summary(k, t) for k in k_blocks])  # [n, L, 1, H, 3, D]
    assert summaries.shape == (n, l, 1, h, 3, d)
    for layer in range(l):
        # the block summary: per-channel min, max and mean over the block's tokens
        kb = k_blocks[:, layer]
        old = torch.stack([kb.amin(dim=2), kb.amax(dim=2), kb.mean(dim=2)], dim=2)  # [n, H, 3, D]
        assert torch.equal(summaries[:, layer, 0], old) and torch.equal(page_summary(kb, t)[:, 0], old)
        for k in (1, 3, 9):
            assert torch.equal(select_pages(summaries[:, layer], q, k), select_blocks(quest_scores(old, q), k))


def test_page_scores_are_half_quests_bound_half_the_mean_key():
    """The score of a page for a KV head: the largest over its query heads of BOUND_WEIGHT x Quest's bound
    (sum over channels of max(q min, q max): no key of the page scores more) + the rest x q . mean key."""
    gen = torch.Generator().manual_seed(2)
    n, h, g, t, d = 5, 2, 3, 8, 4
    keys = torch.randn(n, h, t, d, generator=gen)
    q = torch.randn(h, g, d, generator=gen)
    summary = page_summary(keys, t)[:, 0]  # the block as one page: [n, H, 3, D]
    bound = quest_scores(summary, q, bound_weight=1.0)
    dots = torch.einsum("hgd,nhtd->nhgt", q, keys)  # every key's q.k
    assert (dots.amax(-1).amax(-1) <= bound + 1e-5).all()  # an upper bound
    mean = quest_scores(summary, q, bound_weight=0.0)
    assert torch.allclose(mean, dots.mean(-1).amax(-1), atol=1e-5)  # q . mean key = the mean score
    for h_ in range(h):  # the max over the group is taken of the blend, not of each part
        blend = (0.5 * torch.maximum(q[h_][None] * summary[:, h_, None, 0], q[h_][None] * summary[:, h_, None, 1]).sum(-1)
                 + 0.5 * (q[h_][None] * summary[:, h_, None, 2]).sum(-1)).amax(-1)
        assert torch.allclose(quest_scores(summary, q)[:, h_], blend)


def test_page_selection_picks_pages_inside_blocks():
    """Pages of 2 tokens in blocks of 4: the summary of each page is over its own tokens, the pick is
    block * pages + page, each head its own."""
    k_block = torch.zeros(1, 2, 4, 3)  # [L, H, T, D]
    k_block[0, 0, 3, 0] = 5.0  # head 0: page 1 (tokens 2-3) matches q
    k_block[0, 1, 0, 1] = 5.0  # head 1: page 0
    summaries = torch.cat([torch.zeros(1, 2, 2, 3, 3), page_summary(k_block, 2)])  # 2 blocks: [2, pages, H, 3, D]
    assert summaries[1, 1, 0, 1, 0] == 5.0 and summaries[1, 0, 0, 1, 0] == 0.0
    q = torch.tensor([1.0, 1.0, 0.0]).expand(2, 1, 3)
    assert select_pages(summaries, q, 1).tolist() == [[3, 2]]


def test_log_sum_exp_merge_equals_attention_over_both():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, 16, generator=gen)  # [H, G, N, D]
    k = torch.randn(2, 40, 16, generator=gen)
    v = torch.randn(2, 40, 16, generator=gen)
    out, lse = attend(q, k, v, None, 0.25)
    merged, merged_lse = merge(*attend(q, k[:, :25], v[:, :25], None, 0.25), *attend(q, k[:, 25:], v[:, 25:], None, 0.25))
    torch.testing.assert_close(merged, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged_lse, lse)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q.reshape(6, 4, 16), k.repeat_interleave(3, 0),
                                                            v.repeat_interleave(3, 0), scale=0.25)
    torch.testing.assert_close(out.reshape(6, 4, 16), sdpa, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attend_with_a_mask_is_the_masked_softmax_of_each_query_head(dtype):
    """`attend` (the CPU flash kernel, each KV head's query group as rows): the mask applies to every
    query head of the group alike; out and log-sum-exp equal the materialized formula."""
    gen = torch.Generator().manual_seed(3)
    h, g, n, m, d = 2, 3, 5, 12, 8
    q = torch.randn(h, g, n, d, generator=gen, dtype=dtype)
    k, v = torch.randn(2, h, m, d, generator=gen, dtype=dtype)
    mask = torch.rand(n, m, generator=gen) > 0.4
    mask[:, 0] = True  # every query sees a key
    out, lse = attend(q, k, v, mask, 0.3)
    scores = (q @ k[:, None].transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf"))  # [H, G, N, M]
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1))
    torch.testing.assert_close(out, torch.softmax(scores, dim=-1) @ v[:, None])


# -- the fetch area and the offloaded attention alone, on each device ------------------------------------
L, H, T, D = 2, 2, 4, 8  # layers, KV heads, block tokens, head dim


def host_slots(num_slots: int, device: str, seed: int) -> torch.Tensor:
    """[num_slots, L, 2, H, T, D] random host blocks, pinned on CUDA as the DRAM tier's slots are."""
    host = torch.randn(num_slots, L, 2, H, T, D, generator=torch.Generator().manual_seed(seed))
    return host.pin_memory() if device == "cuda" else host


def blocks_of(host: torch.Tensor, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """What a half holds after a gather of `slots` [n, H]: [2, H, n T, D]."""
    return torch.stack([host[slots[:, h], layer, :, h].permute(1, 0, 2, 3).reshape(2, -1, D)
                        for h in range(H)], dim=1)


@pytest.mark.parametrize("device", DEVICES)
def test_fetch_area_never_writes_a_half_attention_still_reads(device):
    """Exact pieces fetched one ahead, a sparse gather (each head its own blocks, or pages) after each: every read
    sees what was fetched for it. On CUDA each read is queued behind a long matmul, so a copy that did not
    wait for the compute stream would land first; and nothing on the way syncs with the device."""
    host = host_slots(12, device, seed=3)
    fetch = FetchArea(3, H, T, D, torch.float32, torch.device(device), window_tokens=T)
    fetch.host = host
    plan = [(layer, torch.tensor(slots)) for layer in range(L) for slots in ([4, 0, 7], [9, 2], [5])]
    sparse = torch.tensor([[1, 5], [11, 3]])  # [n, H]
    pages = torch.tensor([[0, 1], [1, 1]])    # [n, H]: pages of 2 tokens of those blocks (odd pieces)
    busy = torch.randn(4096, 4096, device=device) if device == "cuda" else None
    seen, want = [], []
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        fetch.begin(plan)
        for i, (layer, slots) in enumerate(plan):
            half, num_tokens, _ = fetch.take()
            assert half == i % 2 and num_tokens == len(slots) * T
            if busy is not None:
                busy @ busy  # the compute stream falls behind the side stream
            seen.append(fetch.kv(half, num_tokens).clone())
            want.append(blocks_of(host, layer, slots[:, None].expand(-1, H)))
            spare = fetch.spare_half()
            assert i + 1 == len(plan) or spare != (i + 1) % 2  # never the half piece i + 1 is landing in
            if i % 2:
                num_tokens = fetch.gather(layer, sparse, spare, pages, page_tokens=2)
                want.append(pages_of(host, layer, sparse, pages, 2))
            else:
                num_tokens = fetch.gather(layer, sparse, spare)
                want.append(blocks_of(host, layer, sparse))
            seen.append(fetch.kv(spare, num_tokens).clone())
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    fetch.end()
    for got, expected in zip(seen, want, strict=True):
        assert torch.equal(got.cpu(), expected)
    assert fetch.copied_bytes == sum(w.numel() for w in want) * 4 and fetch.copy_seconds > 0
    fetch.close()


def pages_of(host: torch.Tensor, layer: int, slots: torch.Tensor, pages: torch.Tensor, p: int) -> torch.Tensor:
    """What a half holds after a gather of pages [k, H] of `slots` [k, H], p tokens each: [2, H, k p, D]."""
    return torch.stack([torch.cat([host[s, layer, :, h, i * p:(i + 1) * p] for s, i in zip(slots[:, h].tolist(),
                                                                                       pages[:, h].tolist())], dim=1)
                        for h in range(H)], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode, half_blocks, page_tokens", [
    ("exact", 2, T),     # 5 host blocks in pieces of 2, merged by log-sum-exp
    ("exact", 8, T),     # all in one half, the window after them: one SDPA call
    ("exact", 2, 2),     # pages do not change exact
    ("sparse:2", 8, T),  # each head its top 2 blocks, one call
    ("sparse:2", 1, T),  # one block a piece
    ("sparse:3", 8, 2),  # each head its top 3 pages of 2 tokens, one call
    ("sparse:3", 1, 2),  # two pages a piece (a block's tokens), then one
    ("sparse:5", 8, 1),  # pages of one token
])
def test_offload_attention_equals_attention_over_its_blocks(device, mode, half_blocks, page_tokens):
    """A decode step of an offloaded sequence, layer by layer: == softmax(q k^T) v over the blocks it
    reads (all, or each KV head's pick of pages) and its device window, computed on the CPU from the host."""
    g, m, scale = 3, 6, 0.3  # query heads per KV head, device window tokens
    host = host_slots(10, device, seed=5)
    slots = torch.tensor([6, 1, 8, 3, 9])  # the sequence's host blocks, in context order
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(L, H * g, 1, D, generator=gen)
    k_dev, v_dev = torch.randn(2, L, H, m, D, generator=gen)
    on = torch.device(device)
    summaries = torch.stack([page_summary(host[s, :, 0], page_tokens) for s in slots.tolist()]).to(on)
    assert summaries.shape == (len(slots), L, T // page_tokens, H, 3, D)
    num_host = len(slots) * T
    off = SeqOffload(parse_offload(mode), slots, summaries, torch.tensor([num_host + m - 1], device=on),
                     torch.arange(num_host, num_host + m, device=on), True, OffloadStats())
    fetch = FetchArea(half_blocks, H, T, D, torch.float32, on, window_tokens=8)
    fetch.host = host
    attention = OffloadAttention(fetch, L, page_tokens)
    attention.plan([off])
    got = [attention.forward(layer, q[layer].to(on), k_dev[layer].to(on), v_dev[layer].to(on), off, scale).cpu()
           for layer in range(L)]
    fetch.end()
    for layer in range(L):
        read = blocks_of(host, layer, slots[:, None].expand(-1, H))
        if mode.startswith("sparse"):
            # the pick itself, made on the device as the attention makes it (not the point here)
            k, per_block = int(mode.partition(":")[2]), T // page_tokens
            top = select_pages(summaries[:, layer], q[layer].view(H, g, D).to(on), k).cpu()  # [k, H]
            assert 0 < k < len(slots) * per_block
            read = pages_of(host, layer, slots[top // per_block], top % per_block, page_tokens)
        kv = torch.cat([read, torch.stack([k_dev[layer], v_dev[layer]])], dim=2)
        q4 = q[layer].view(H, g, D)
        want = torch.softmax(q4 @ kv[0].transpose(1, 2) * scale, dim=-1) @ kv[1]  # [H, g, D]
        torch.testing.assert_close(got[layer], want.reshape(H * g, 1, D), rtol=1e-4, atol=1e-5)
    assert off.stats.fetched_bytes == fetch.copied_bytes > 0
    fetch.close()


@cuda
def test_host_slots_are_pinned_on_cuda(cuda_tiny_model):
    """The copies are non_blocking from the DRAM tier's own slots: pinned, or the driver stages them."""
    engine, manager = make(cuda_tiny_model)
    assert manager.tiers[0]._arena.is_pinned() and engine.fetch.host.is_pinned()
    with pytest.raises(ValueError, match="pinned"):
        engine.fetch.host = torch.zeros(2, *engine.fetch.host.shape[1:], dtype=engine.fetch.host.dtype)
    engine.close()
    manager.close()
