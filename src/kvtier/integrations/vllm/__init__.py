"""kvtier as a vLLM KV connector (vLLM >= 0.32, v1 engine): the tiers under vLLM's own prefix cache.

    python -m vllm.entrypoints.openai.api_server --model DIR --block-size 32 --distributed-executor-backend uni \\
      --kv-transfer-config '{"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"tiers": ["dram:4GiB", "ssd:/var/cache/kvtier:100GiB"], "codec": "raw"}}'

The connector class is imported on first use (it imports vLLM), so `plan` and `config` load without vLLM.
"""


def __getattr__(name: str):
    if name in ("KvtierConnector", "KvtierMetadata"):
        from kvtier.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KvtierConnector", "KvtierMetadata"]
