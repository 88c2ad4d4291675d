"""Training benchmarks (llmkit.training against the reference loop)."""
