"""Attention kernels: the inner ``softmax(q kᵀ / √d + bias) v`` over (B, H, T, D) tensors."""
