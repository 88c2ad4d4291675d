"""Triton kernels, each beside the plain-PyTorch reference it is tested against.

:mod:`llmkit.kernels.runtime` decides per call whether a kernel runs as Triton (a CUDA
tensor, or any tensor under ``TRITON_INTERPRET=1``) or falls back to its reference path.
"""
