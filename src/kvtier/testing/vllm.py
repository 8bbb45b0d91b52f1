"""The tests' names for the vLLM / LMCache launchers, which the product owns (`kvtier bench vllm` starts them):
`kvtier.bench.servers`. A test that patches a launcher's setting patches it there."""

from kvtier.bench.servers import (BLOCK_TOKENS, LMCACHE_PYTHON, ROOT, VLLM_PYTHON, DisaggSystem, LmcacheServer,
                                  VllmServer, _stop_group, kvtier_transfer_config)

__all__ = ["BLOCK_TOKENS", "LMCACHE_PYTHON", "ROOT", "VLLM_PYTHON", "DisaggSystem", "LmcacheServer", "VllmServer",
           "_stop_group", "kvtier_transfer_config"]
