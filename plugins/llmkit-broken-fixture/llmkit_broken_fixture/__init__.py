"""A deliberately broken llmkit plugin: importing it raises.

Never installed where the user works: the tests that need its entry point
(``broken_fixture``) install it into a throwaway directory on ``sys.path``. It proves that
one plugin failing to import is reported by name, with its error, while every command keeps
working (and that ``LLMKIT_STRICT_PLUGINS=1`` turns it into an error). It registers nothing.
An install left by an older set-up is removed by ``make test``, or
``pip uninstall llmkit-broken-fixture``.
"""

from __future__ import annotations

MESSAGE = (
    "llmkit-broken-fixture is a test fixture that always fails to import "
    "(uninstall it, or leave 'broken_fixture' out of LLMKIT_PLUGINS)"
)

raise RuntimeError(MESSAGE)
