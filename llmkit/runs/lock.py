"""One training process per run directory: an exclusive ``flock`` on ``<run>/.lock``.

The lock is held for the whole training. The operating system releases it when the holding
process ends in any way (SIGKILL included), so a lock left by a killed process never blocks
the next run; the file itself stays, holding the pid of the last holder (deleting it would
let two processes lock two different files). Under torchrun only rank 0 takes it: every
rank shares the directory. ``flock`` works across hosts on NFS (Linux emulates it with
POSIX locks there) but not on every network file system.
"""

from __future__ import annotations

import os
from pathlib import Path

from llmkit.errors import LlmkitError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no lock
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"


class RunInUse(LlmkitError):
    """Another process is training in the run directory."""


class RunLock:
    """The exclusive lock of one run directory (:meth:`acquire`, :meth:`release`)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock without waiting: :class:`RunInUse` naming the run and the holder's
        pid when another process holds it."""
        if fcntl is None or self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunInUse(
                f"{self.run_dir} is in use by another training process (pid {holder}); "
                "wait for it to end or stop it"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None
