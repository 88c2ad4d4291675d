"""Kernels: the Triton kernels, each beside the plain-PyTorch reference it is tested
against, and the CPU paths that stand in for them.

:mod:`llmkit.kernels.runtime` decides per call whether a kernel runs as Triton (a CUDA
tensor, or any tensor under ``TRITON_INTERPRET=1``) or falls back to its reference path;
:mod:`llmkit.kernels.block_local` is the sliding window's block-local CPU path (torch's fused
CPU attention on query chunks, a flash-style backward) and
:mod:`llmkit.kernels.worker_threads` the head-parallel threads it runs large calls on;
:mod:`llmkit.kernels.attention_dropout` is attention with dropout on the CPU (for ``sdpa``).
"""
