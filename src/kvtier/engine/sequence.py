"""One request inside the engine: its tokens, its block table and where it is in its life."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.blocks import KeyChain
    from kvtier.offload.attention import HostBlocks

# what torch.Generator.manual_seed accepts (negative seeds are mapped onto the unsigned range)
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1


MAX_LOGPROBS = 20  # top logprobs per token at most (OpenAI's chat limit, vLLM's default max_logprobs)


@dataclass(slots=True)
class SamplingParams:
    """What the sampler handles (vLLM's semantics): temperature 0 (or below `sampler.MIN_TEMPERATURE`)
    is greedy; top_p in (0, 1], a tiny top_p keeps the most likely token only; top_k 0 keeps all;
    min_p drops tokens below min_p x the top probability; seed within `MIN_SEED..MAX_SEED`.

    Penalties act on the logits before temperature: `repetition_penalty` divides the positive (and
    multiplies the negative) logits of every token seen in the prompt or the output; `presence_penalty`
    and `frequency_penalty` subtract from the logits of output tokens once / per occurrence.
    `logit_bias` is added to the logits; `allowed_token_ids` masks every other token. Until
    `min_tokens` are generated, EOS and `stop_token_ids` cannot be sampled.

    `logprobs`: the log-probability of each sampled token and of the `logprobs` most likely ones (0:
    the sampled token's only); `prompt_logprobs`: the same for every prompt token after the first
    (the whole prompt is computed: no prefix-cache hit). Logprobs are of the model's raw distribution
    (log_softmax of its logits, before penalties, bias and temperature), as vLLM reports them."""

    max_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0            # 0: all tokens
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None
    kv_offload: str | None = None  # "off" | "exact" | "sparse:BUDGET"; None: the engine's default (kvtier/offload/)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    allowed_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: all tokens), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [{MIN_SEED}, {MAX_SEED}], got {self.seed}")
        if self.kv_offload is not None:
            from kvtier.config import parse_offload

            parse_offload(self.kv_offload)  # ValueError naming the accepted forms
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if any(not -100 <= bias <= 100 for bias in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def token_ids_used(self) -> list[int]:
        """Token ids this request names (checked against the vocabulary at admission)."""
        return [*self.stop_token_ids, *self.logit_bias, *(self.allowed_token_ids or [])]


@dataclass(slots=True)
class TokenLogprob:
    """A token's log-probability, its rank in the distribution (1: the most likely) and the
    distribution's `k` most likely tokens, best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


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
    num_keyed_blocks: int = 0         # its first full, computed blocks: keyed (`block_keys`), a prefix of block_ids
    num_cached_tokens: int = 0        # prompt tokens found cached at (first) admission
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_loading_blocks: int = 0       # blocks the transfer worker is filling while WAITING_FOR_KV
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None          # why it failed (finish_reason "error")
    admitted: bool = False
    key_chain: "KeyChain | None" = None  # its block keys, grown with its tokens, never rehashed (scheduler)
    host: "HostBlocks | None" = None  # offloaded (longer than the device holds): its middle blocks in host memory
    # prompt_logprobs requested: one entry per prompt token computed so far (the first token's is None)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self) -> None:
        if self.sampling.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def needs_prompt_logits(self) -> bool:
        """It asked for prompt logprobs and its prompt has not been computed all through yet (so it
        computes every prompt position: no prefix-cache hit)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def block_keys(self) -> list[bytes]:
        """Keys of its full, computed blocks: the first `num_keyed_blocks` of its `key_chain` (the one list)."""
        return self.key_chain.keys[:self.num_keyed_blocks] if self.key_chain is not None else []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_device_blocks(self) -> int:
        """Blocks in the device arena (an offloaded sequence's table has holes: -1, in host memory)."""
        return sum(1 for block_id in self.block_ids if block_id >= 0)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

