"""Generation benchmarks (llmkit.inference against transformers)."""
