"""The engine's saves (`kvtier serve`: `LLMEngine` -> `TierIO.store` -> `BlockMover.save` -> manager ->
tiers) carry only a step's new full blocks; with them goes the chain each extends (`_extended_chains`), so
the DRAM tier refreshes a conversation's earlier blocks with its new turn, tail first, and a full tier
evicts other requests before the root the turn extends.

Request A's turn 1 (3 blocks), then request B (4 blocks), then A's turn 2 (its prompt is turn 1's plus 2
blocks: turn 1's blocks come from the device's prefix cache, only the 2 new ones are saved), then C.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.blocks import block_keys
from kvtier.codecs import get_codec
from kvtier.engine import EngineConfig, LLMEngine, SamplingParams
from kvtier.tiers.manager import build_manager

BLOCK = 8


def _prompts() -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, 256, (8 * BLOCK,), generator=gen).tolist()
    a1 = tokens[:3 * BLOCK]
    return {"a1": a1, "b": tokens[3 * BLOCK:7 * BLOCK], "a2": a1 + tokens[7 * BLOCK:] + [5] * BLOCK,
            "c": [9] * (4 * BLOCK)}


@pytest.mark.parametrize("num_slots, later, b_held", [(10, ["c"], [True] + [False] * 3), (7, [], [True] * 2 + [False] * 2)],
                         ids=["later-requests-evict-others", "the-turn-s-own-save-evicts-others"])
def test_a_turn_s_save_keeps_the_whole_conversation_in_a_full_dram_tier(tiny_model, num_slots, later, b_held):
    layout = tiny_model.kv_layout(BLOCK)
    slot = get_codec("raw").max_encoded_bytes(layout)
    manager = build_manager([f"dram:{num_slots * slot}"], slot_bytes=slot)
    try:
        config = EngineConfig(device_kv_budget_bytes=64 * layout.block_bytes, block_tokens=BLOCK,
                              max_prefill_tokens=16, synchronous_transfers=True)
        engine = LLMEngine(tiny_model, config, manager)
        prompts = _prompts()
        one = SamplingParams(max_tokens=1)  # the prompt's KV only: every prompt block full, nothing after
        for name in ["a1", "b", "a2", *later]:
            engine.generate([prompts[name]], one)
        engine.wait_for_transfers()
        space = engine.scheduler.space
        turn2, other = block_keys(space, prompts["a2"]), block_keys(space, prompts["b"])
        assert len(turn2) == 5 and engine.stats().num_blocks_written_to_tiers == 3 + 4 + 2 + len(later) * 4
        # turn 2's whole chain, root first, is a prefix of what DRAM holds; B made the room
        assert manager.match(turn2).keys == turn2
        assert manager.contains_many(other) == b_held  # B's blocks went tail first
    finally:
        manager.close()
