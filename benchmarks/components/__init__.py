"""Benchmarks of the built-in components, parametrized over the registry."""
