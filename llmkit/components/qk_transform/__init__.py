"""Q/K transforms: position-wise maps of queries and keys inside the attention module, before
positions and the kernel (see :mod:`llmkit.contracts`)."""
