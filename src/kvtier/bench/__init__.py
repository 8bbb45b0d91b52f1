"""Benchmarks behind docs/BENCHMARKS.md (`kvtier bench ...`)."""
