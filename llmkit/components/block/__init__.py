"""Residual blocks: how a layer's attention, ffn and norms combine into the residual stream
(see :mod:`llmkit.contracts`)."""
