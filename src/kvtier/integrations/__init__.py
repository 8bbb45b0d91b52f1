"""kvtier under other engines: `kvtier.integrations.vllm` is a vLLM v1 KV connector backed by the tier stack."""
