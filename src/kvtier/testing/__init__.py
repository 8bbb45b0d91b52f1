"""Test-only helpers (app threads, Dynamo stand-ins, a KV event tap), not shipped in the wheel and never imported
by the product. `services` and `vllm` re-export the launchers the product owns (`kvtier.bench.pools`,
`kvtier.bench.servers`, `kvtier.ports`) under the names the tests use."""
