"""Process launchers for the tests and the benchmarks, not used by the product: local pool services
(`services`: a Mooncake pool, redis-server) and real vLLM / LMCache servers (`vllm`), on 127.0.0.1."""
