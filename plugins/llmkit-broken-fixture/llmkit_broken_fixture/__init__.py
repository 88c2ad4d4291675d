"""A deliberately broken llmkit plugin: importing it raises.

Installed with llmkit's development set-up so that its entry point (``broken_fixture``)
exists, it proves that one plugin failing to import is reported by name, with its error,
while every command keeps working (and that ``LLMKIT_STRICT_PLUGINS=1`` turns it into an
error). It registers nothing. To stop loading it, leave it out of ``$LLMKIT_PLUGINS`` or
``pip uninstall llmkit-broken-fixture``.
"""

from __future__ import annotations

MESSAGE = (
    "llmkit-broken-fixture is a test fixture that always fails to import "
    "(uninstall it, or leave 'broken_fixture' out of LLMKIT_PLUGINS)"
)

raise RuntimeError(MESSAGE)
