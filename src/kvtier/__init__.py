"""kvtier: size, shrink and spill the KV cache of long-context LLM inference."""

__version__ = "0.1.0"
