"""Compiled C kernels: build a C source with the system compiler into the cache, once, and
load it with ctypes.

A kernel is one :class:`NativeLibrary`: its name, its C source and its functions' ctypes
signatures. ``NativeLibrary.load()`` gives the library, built on first use, or None where it
is off or cannot be built (``NativeLibrary.unavailable_reason()`` says why); the caller then
runs its PyTorch path. A second kernel is one more ``NativeLibrary(...)`` beside its source
(see :mod:`llmkit.kernels.window_native`).

**Build.** The source is compiled by the C compiler (``$CC``, else ``cc``, ``gcc`` or
``clang``) into the cache (``$LLMKIT_CACHE_DIR/kernels``, see
:func:`llmkit.files.store_root`), under a name that hashes the source, the compiler, its
flags and the CPU's flags, so a cache shared between machines never loads a library built
for another CPU. The flag sets of ``builds`` are tried in order (by default with OpenMP,
then without): a build the compiler rejects leaves a ``.rejected`` file with its error
beside where the library would be, so later processes do not ask again; a timeout or a
crashed compiler leaves none; a cached build that does not load in this process gives way
to the next. ``LLMKIT_NATIVE_KERNELS=0`` turns every compiled kernel off.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from llmkit.files import store_root
from llmkit.hardware import cpuinfo_field

#: Set to ``0`` to keep the compiled kernels off (their PyTorch paths run instead).
ENV = "LLMKIT_NATIVE_KERNELS"
#: Compiler flags of a cached build: tuned for the CPU it runs on.
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-march=native")
#: Added to :data:`FLAGS` for the build tried first by default.
OPENMP = ("-fopenmp",)
#: Libraries linked after the source (by default; not part of the cache key).
LIBS = ("-lm",)
#: Seconds a build may take (a kernel takes about one).
BUILD_TIMEOUT = 120

#: A function's ctypes signature: (restype, argtypes); argtypes None leaves them unchecked.
Signature = tuple[Any, Sequence[Any] | None]


def enabled() -> bool:
    """False when ``LLMKIT_NATIVE_KERNELS=0`` (or ``false``/``no``/``off``)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def compiler() -> list[str] | None:
    """The C compiler's command: ``$CC`` (every word, so ``ccache gcc`` works), else the first
    of cc, gcc, clang on PATH; None if its program is not found."""
    if os.environ.get("CC", "").strip():
        words = shlex.split(os.environ["CC"])
        found = shutil.which(words[0])
        return [found, *words[1:]] if found else None
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def cpu_flags() -> str:
    """The CPU's feature flags as the OS reports them (Linux: /proc/cpuinfo), else its name."""
    found = cpuinfo_field(("flags", "Features"))
    return found if found is not None else f"{platform.machine()} {platform.processor()}"


class CompileError(RuntimeError):
    """The compiler ran and rejected the source or its flags (not a timeout or a crash)."""


class _Unavailable(RuntimeError):
    """Why no build could be loaded (the message is the reason :meth:`NativeLibrary.load`
    keeps)."""


class NativeLibrary:
    """One C source compiled into the cache and loaded with ctypes.

    ``name``: the prefix of the built file's name (``<name>-<hash>.so``); ``source``: the C
    file; ``signatures``: each exported function's ``(restype, argtypes)``, set on load;
    ``builds``: the flag sets tried in order; ``libs``: linked after the source."""

    def __init__(
        self,
        name: str,
        source: Path,
        signatures: Mapping[str, Signature],
        *,
        builds: Sequence[tuple[str, ...]] = (FLAGS + OPENMP, FLAGS),
        libs: tuple[str, ...] = LIBS,
    ) -> None:
        self.name = name
        self.source = source
        self.signatures = dict(signatures)
        self.builds = tuple(builds)
        self.libs = libs
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {}  # "lib": the loaded library or None; "why": if None

    def __repr__(self) -> str:
        return f"NativeLibrary({self.name!r}, {str(self.source)!r})"

    def library_name(self, cc: list[str], flags: tuple[str, ...]) -> str:
        """File name of the library built from the source with this compiler command and
        flags on this CPU (a hash of all four, and of ``libs`` where they are not the
        default)."""
        key = hashlib.sha256()
        parts: list[bytes | str] = [self.source.read_bytes(), " ".join(cc), " ".join(flags)]
        parts.append(cpu_flags())
        if self.libs != LIBS:  # (the default stays out: it keeps existing caches' names)
            parts.append(" ".join(self.libs))
        for part in (p if isinstance(p, bytes) else p.encode() for p in parts):
            key.update(part)
            key.update(b"\0")
        suffix = ".dylib" if sys.platform == "darwin" else ".so"
        return f"{self.name}-{key.hexdigest()[:20]}{suffix}"

    def built_path(
        self, cc: list[str], flags: tuple[str, ...], directory: Path | None = None
    ) -> Path:
        """Where :meth:`build` puts the library for ``cc`` and ``flags`` (default directory:
        the cache's ``kernels``)."""
        folder = directory if directory is not None else store_root() / "kernels"
        return folder / self.library_name(cc, flags)

    def build(
        self, cc: list[str], flags: tuple[str, ...] = FLAGS, directory: Path | None = None
    ) -> Path:
        """The library compiled from the source with the command ``cc`` and ``flags`` into
        ``directory`` (default: the cache's ``kernels``), reused if already there. Raises
        :class:`CompileError` with the compiler's first error line if it rejects them, and
        RuntimeError if it cannot run or takes over :data:`BUILD_TIMEOUT` seconds."""
        path = self.built_path(cc, flags, directory)
        if path.exists():
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        cmd = [*cc, *flags, "-o", str(tmp), str(self.source), *self.libs]
        name = Path(cc[0]).name
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, check=False, timeout=BUILD_TIMEOUT
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{name} did not finish: {err}") from err
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            lines = (done.stderr or done.stdout).splitlines()
            errors = [ln for ln in lines if "error" in ln.lower()]
            first = errors[0].strip() if errors else f"exit status {done.returncode}"
            raise CompileError(f"{name} failed: {first}")
        os.replace(tmp, path)  # atomic: a concurrent build writes the same bytes
        return path

    def load_file(self, path: Path) -> ctypes.CDLL:
        """The library at ``path`` with its functions' signatures set."""
        lib = ctypes.CDLL(str(path))
        for function, (restype, argtypes) in self.signatures.items():
            fn = getattr(lib, function)
            fn.restype = restype
            if argtypes is not None:
                fn.argtypes = list(argtypes)
        return lib

    def load(self) -> ctypes.CDLL | None:
        """The library, built on first use; None where it is off or cannot be built."""
        if not enabled():
            return None
        with self._lock:
            if "lib" not in self._state:
                cc = compiler()
                if cc is None:
                    given = os.environ.get("CC", "").strip()
                    why = f"CC={given} not found" if given else "no C compiler found (set CC)"
                    self._state.update(lib=None, why=why)
                elif os.name != "posix":
                    self._state.update(lib=None, why="built on POSIX systems only")
                else:
                    try:
                        self._state.update(lib=self._first_loadable(cc), why=None)
                    except _Unavailable as err:  # none: the PyTorch path runs
                        self._state.update(lib=None, why=str(err))
                    except (OSError, RuntimeError) as err:  # the cache or source unreadable
                        self._state.update(lib=None, why=f"build failed: {err}")
            return self._state["lib"]

    def unavailable_reason(self) -> str | None:
        """Why :meth:`load` returns None (after a call), else None."""
        if not enabled():
            return f"turned off by {ENV}"
        return self._state.get("why")

    def forget(self) -> None:
        """Forget the loaded library (or the reason there is none): the next :meth:`load`
        builds or loads again."""
        with self._lock:
            self._state.clear()

    def _first_loadable(self, cc: list[str]) -> ctypes.CDLL:
        """The first of :attr:`builds` that loads, each from the cache or compiled now. A
        build the compiler rejected (say ``-fopenmp`` without an OpenMP library) leaves a
        ``.rejected`` file with its error beside where the library would be, so later
        processes do not ask again; a timeout or a crash leaves none. Raises the last
        failure."""
        failure = _Unavailable("no build tried")
        for flags in self.builds:
            path = self.built_path(cc, flags)
            rejected = path.with_name(f"{path.name}.rejected")
            if not path.exists() and rejected.exists():
                failure = _Unavailable(
                    f"build failed earlier: {rejected.read_text().strip()} (delete {rejected} "
                    "to try again)"
                )
                continue
            try:
                built = self.build(cc, flags)
            except CompileError as err:
                with contextlib.suppress(OSError):  # an unwritable cache only costs a retry
                    rejected.write_text(f"{err}\n")
                failure = _Unavailable(f"build failed: {err}")
                continue
            except RuntimeError as err:
                failure = _Unavailable(f"build failed: {err}")
                continue
            try:
                return self.load_file(built)
            except OSError as err:  # e.g. an OpenMP runtime this process cannot find
                failure = _Unavailable(f"load failed: {err}")
        raise failure
