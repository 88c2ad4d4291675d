"""One module per Hugging Face architecture family (see :mod:`llmkit.interop.family`)."""
