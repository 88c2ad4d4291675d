"""User-facing errors: the CLI prints them as one line and exits 2."""

import os
from pathlib import Path


class LlmkitError(Exception):
    """An error a user can cause and fix (bad spec, unknown component, missing file)."""


class SpecError(LlmkitError):
    """A spec that failed validation; carries every problem found, each with its path."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = list(problems)
        self.source = source
        where = f"{source}: " if source else ""
        if len(self.problems) == 1:
            msg = f"{where}{self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            msg = f"{where}{len(self.problems)} problems\n{lines}"
        super().__init__(msg)


class RegistryError(LlmkitError):
    """An unknown or conflicting component."""


class PluginError(LlmkitError):
    """A plugin that failed to import or to register."""


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first non-empty line (its type's name if it has no
    message), for one-line errors that quote a library's."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` reports a full disk or quota: an ``OSError`` with ENOSPC/EDQUOT, or a
    library's error quoting one (safetensors: "No space left on device (os error 28)";
    pyarrow's write errors)."""
    import errno

    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return any(m in text for m in ("No space left on device", "os error 28", "quota exceeded"))


def mount_point(path: str | os.PathLike[str]) -> Path:
    """The mount point of the file system holding ``path`` (or its nearest existing parent)."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return p


def no_space_message(path: str | os.PathLike[str]) -> str:
    """``no space left on device writing PATH (the disk mounted at M is full)``."""
    return (
        f"no space left on device writing {path} (the disk mounted at {mount_point(path)} is full)"
    )
