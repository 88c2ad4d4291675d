"""Position-wise feed-forward blocks mapping (B, T, C) to (B, T, C)."""
