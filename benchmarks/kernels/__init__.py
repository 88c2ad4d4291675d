"""Kernel benchmarks (llmkit.bench.kernels over every benchmarkable kind)."""
