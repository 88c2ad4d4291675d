"""Positional schemes acting on embeddings, on q/k (rotary), or as attention score biases."""
