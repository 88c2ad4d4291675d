"""``python -m llmkit.cli``: the same as the ``llmkit`` command."""

from llmkit.cli import main

raise SystemExit(main())
