"""The scheduler without tensors: preemption drops a sequence's blocks (its full blocks stay keyed in the
device cache), and readmission reuses them and recomputes only the partial last block."""

from kvtier.blocks import KeySpace, KVLayout, block_keys
from kvtier.engine.block_manager import BlockManager
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.sequence import SamplingParams, Sequence, SeqStatus

BLOCK = 4


def make_scheduler(num_blocks: int) -> Scheduler:
    space = KeySpace("test-model", KVLayout(1, 1, 4, block_tokens=BLOCK))
    return Scheduler(BlockManager(num_blocks), space, max_num_seqs=2, max_prefill_tokens=64)


def step(scheduler: Scheduler, token: int = 1):
    out = scheduler.schedule()
    scheduler.postprocess(out, {chunk.seq.request_id: token for chunk in out.chunks})
    return out


def test_preempted_sequence_keeps_its_full_blocks_and_recomputes_the_partial_one():
    scheduler = make_scheduler(4)
    a = Sequence("a", list(range(10, 16)), 6, SamplingParams(max_tokens=5, ignore_eos=True))
    b = Sequence("b", list(range(20, 23)), 3, SamplingParams(max_tokens=20, ignore_eos=True))
    scheduler.add(a), scheduler.add(b)
    for _ in range(3):  # a: 2 blocks, b: 1, then b's second block: the device is full
        assert not step(scheduler).preempted
    assert (a.block_ids, b.block_ids, b.num_computed_tokens) == ([0, 1], [2, 3], 5)
    b_full_key = b.block_keys[0]

    out = step(scheduler)  # a needs its third block: b (the youngest) is preempted
    assert out.preempted == ["b"] and scheduler.num_preemptions == 1
    assert b.status is SeqStatus.WAITING and b.block_ids == [] and b.num_computed_tokens == 0
    assert list(scheduler.waiting) == [b]
    assert a.block_ids == [0, 1, 3]  # b's partial block went back to the free list and is a's now
    assert scheduler.block_manager.key_to_block[b_full_key] == 2  # b's full block: cached, not freed

    out = step(scheduler)  # no room for b beside a (a block in reserve for a's next decode)
    assert [chunk.seq for chunk in out.chunks] == [a] and a.status is SeqStatus.FINISHED

    out = step(scheduler)  # b comes back: its full block from the device cache, the rest recomputed
    assert b.status is SeqStatus.RUNNING and b.block_ids[0] == 2
    [chunk] = out.chunks
    assert (chunk.seq, chunk.start, chunk.num_tokens) == (b, 4, 2)  # its 6 tokens: 4 cached, 2 recomputed
    assert b.num_computed_tokens == 6 and b.num_tokens == 7
    assert b.block_keys == block_keys(scheduler.space, b.token_ids)[:1]
    assert b.cached_tokens_by_tier == {}  # hits count at the first admission only


def test_a_sequences_blocks_are_hashed_once_however_long_it_waits_and_after_preemption(monkeypatch):
    import kvtier.blocks

    hashed = []
    real = kvtier.blocks.chain_key
    monkeypatch.setattr(kvtier.blocks, "chain_key", lambda parent, tokens: hashed.append(tuple(tokens)) or
                        real(parent, tokens))
    scheduler = make_scheduler(4)
    a = Sequence("a", list(range(10, 23)), 13, SamplingParams(max_tokens=3, ignore_eos=True))  # the 4 blocks
    b = Sequence("b", list(range(30, 39)), 9, SamplingParams(max_tokens=2, ignore_eos=True))   # 2 full blocks
    scheduler.add(a), scheduler.add(b)
    for _ in range(3):  # b waits while a holds the device: tried for admission every step
        step(scheduler)
        assert b.status is SeqStatus.WAITING
    while scheduler.has_unfinished():
        step(scheduler)
    assert a.status is b.status is SeqStatus.FINISHED
    # every full block of each sequence (prompt and generated) hashed exactly once
    assert len(hashed) == len(set(hashed)) == len(a.block_keys) + len(b.block_keys) == 3 + 2
    assert a.block_keys == block_keys(scheduler.space, a.token_ids)[:3]
