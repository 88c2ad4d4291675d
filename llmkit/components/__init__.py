"""llmkit's built-in components, one subpackage per kind and one module per component.

This package stays import-light (no torch at import time): the registry imports each
component's module lazily from its ``module:attr`` target in ``registry.toml``.
"""
