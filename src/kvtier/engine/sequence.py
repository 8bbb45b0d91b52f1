"""One request inside the engine: its tokens, its block table and where it is in its life."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"bad sampling: temperature={self.temperature}, top_p={self.top_p}")


class SeqStatus(enum.Enum):
    WAITING = "waiting"    # not admitted, or preempted by recompute
    WAITING_FOR_KV = "waiting_for_kv"  # holds device blocks; its cached prefix is being loaded from the tiers
    RUNNING = "running"    # holds device blocks
    SWAPPED = "swapped"    # its KV is in host memory
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]              # prompt + generated
    num_prompt_tokens: int
    sampling: SamplingParams
    namespace: str = ""
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0      # tokens whose KV is in the device blocks
    block_ids: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # keys of the full, computed blocks (a prefix of block_ids)
    num_cached_tokens: int = 0        # prompt tokens found cached at (first) admission
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_swapped_blocks: int = 0       # blocks of KV held on the host while SWAPPED
    finish_reason: str | None = None
    admitted: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        return self.num_computed_tokens == self.num_tokens - 1 and self.num_generated_tokens > 0
