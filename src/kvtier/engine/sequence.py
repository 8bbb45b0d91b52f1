"""One request inside the engine: its tokens, its block table and where it is in its life."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.engine.offload import HostBlocks

# what torch.Generator.manual_seed accepts (negative seeds are mapped onto the unsigned range)
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1


@dataclass(slots=True)
class SamplingParams:
    """What the sampler handles: temperature 0 (or below `sampler.MIN_TEMPERATURE`) is greedy; top_p in
    (0, 1], a tiny top_p keeps the most likely token only; seed within `MIN_SEED..MAX_SEED`."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    kv_offload: str | None = None  # "off" | "exact" | "sparse:BUDGET"; None: the engine's default (engine/offload.py)

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [{MIN_SEED}, {MAX_SEED}], got {self.seed}")
        if self.kv_offload is not None:
            from kvtier.engine.offload import parse_offload

            parse_offload(self.kv_offload)  # ValueError naming the accepted forms


class SeqStatus(enum.Enum):
    WAITING = "waiting"    # not admitted, or preempted (its blocks released; its prefix found again at readmission)
    WAITING_FOR_KV = "waiting_for_kv"  # holds device blocks; its cached prefix is being loaded from the tiers
    RUNNING = "running"    # holds device blocks
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]              # prompt + generated
    num_prompt_tokens: int
    sampling: SamplingParams
    namespace: str = ""
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0      # tokens whose KV is computed (in device blocks, or host blocks if offloaded)
    block_ids: list[int] = field(default_factory=list)  # -1: a block in host memory (offloaded sequences)
    block_keys: list[bytes] = field(default_factory=list)  # keys of the full, computed blocks (a prefix of block_ids)
    num_cached_tokens: int = 0        # prompt tokens found cached at (first) admission
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_loading_blocks: int = 0       # blocks the transfer worker is filling while WAITING_FOR_KV
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None          # why it failed (finish_reason "error")
    admitted: bool = False
    host: "HostBlocks | None" = None  # offloaded (longer than the device holds): its middle blocks in host memory

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

