"""llmkit: build language models from interchangeable, registry-resolved components.

Importing this package is cheap (no torch): the public plugin API is ``llmkit.hookimpl``.
"""

from llmkit.hookspecs import hookimpl

__version__ = "0.1.0"
__all__ = ["__version__", "hookimpl"]
