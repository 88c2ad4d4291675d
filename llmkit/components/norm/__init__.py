"""Normalization layers over the last dimension."""
