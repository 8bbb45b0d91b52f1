"""Benchmarks behind docs/BENCHMARKS.md (`kvtier bench ...`; every run, by topic: docs/benchmarks/)."""
