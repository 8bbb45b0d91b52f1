"""The serving engine: a paged device KV arena on a fixed byte budget, continuous batching,
prefix reuse across the device and the tiers, and preemption that finds a sequence's full blocks
there again (only its partial last block is recomputed)."""

from kvtier.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from kvtier.config import EngineConfig
from kvtier.engine.engine import ContextLengthError, EngineStats, LLMEngine, RequestOutput
from kvtier.engine.sequence import SamplingParams

__all__ = ["AsyncEngine", "ContextLengthError", "EngineDeadError", "EngineConfig", "EngineStats", "LLMEngine",
           "RequestFailedError", "RequestOutput", "SamplingParams"]
