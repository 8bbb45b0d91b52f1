"""The serving engine: a paged device KV arena on a fixed byte budget, continuous batching,
prefix reuse across the device and the tiers, and swap preemption to host memory."""

from kvtier.engine.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from kvtier.engine.engine import ContextLengthError, EngineConfig, EngineStats, LLMEngine, RequestOutput
from kvtier.engine.sequence import SamplingParams

__all__ = ["AsyncEngine", "ContextLengthError", "EngineDeadError", "EngineConfig", "EngineStats", "LLMEngine",
           "RequestFailedError", "RequestOutput", "SamplingParams"]
