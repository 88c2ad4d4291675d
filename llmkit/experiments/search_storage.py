"""Where a search's study lives: the database URL a search file's ``storage`` (or
``--storage``) names, checked and opened before the search's directory is made, and Optuna
kept quiet.

A search file's ``storage`` may name any database URL: llmkit connects to it with Optuna
(SQLAlchemy). Each URL is parsed, then opened, before the search's directory is made;
whatever goes wrong is one line naming the URL (its password hidden).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmkit.errors import LlmkitError, first_line

if TYPE_CHECKING:
    from llmkit.experiments.search import SearchSpec

#: Seconds between a running trial's heartbeats; a trial silent for longer is stale.
HEARTBEAT_S = 20


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna without its chatter: no ``ExperimentalWarning`` (heartbeats are experimental),
    no warning about choices that are tables (llmkit's ``choice`` takes any value ``--set``
    takes; the study stores them as JSON) and no log lines below errors (a failed or pruned
    trial is reported by the search's own lines); all restored afterwards."""
    import optuna

    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.filterwarnings(
                "ignore", "Choices for a categorical distribution should be", UserWarning
            )
            yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def shown_url(url: str) -> str:
    """A database URL as errors show it: its password hidden, when it parses."""
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        return url if parsed.password is None else parsed.render_as_string(hide_password=True)
    except Exception:  # not a URL (the problem says so), or no SQLAlchemy
        return url if len(url) <= 200 else url[:199] + "…"


def storage_problem(url: str) -> str | None:
    """Why ``url`` cannot hold a study, read from the URL alone (nothing is opened): empty,
    not a URL, a port outside 1–65535, an in-memory SQLite database (gone with the process,
    and Optuna's heartbeat thread cannot reach it); None when it may."""
    if not url.strip():
        return "an empty database URL; give one such as sqlite:///path/study.db"
    try:
        from sqlalchemy.engine import make_url
    except ImportError:  # no Optuna either: the search says so itself
        return None
    example = "e.g. sqlite:///path/study.db or postgresql://user@host/db"
    try:
        parsed = make_url(url)
    except Exception as exc:  # ArgumentError, ValueError (a port that is no number), …
        return f"{shown_url(url)!r} is not a database URL ({first_line(exc)}); {example}"
    if parsed.port is not None and not 0 < parsed.port < 65536:
        return f"{shown_url(url)!r}: port {parsed.port} is not a port (1-65535)"
    memory = parsed.database in (None, "", ":memory:") or "memory" in str(parsed.query.get("mode"))
    if parsed.get_backend_name() == "sqlite" and memory:
        return (
            f"{shown_url(url)!r} is an in-memory SQLite database, gone with the process; "
            "name a file: sqlite:///path/study.db"
        )
    return None


def open_storage(url: str, where: str) -> Any:
    """Optuna's storage of the study in ``url`` (its tables made when new), or a one-line
    :class:`LlmkitError` naming ``where`` the URL came from (``--storage``, the search file)
    and what went wrong: a URL that is none, an unknown dialect, a driver not installed, a
    database that cannot be opened."""
    problem = storage_problem(url)
    if problem:
        raise LlmkitError(f"{where}: {problem}")
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    try:
        with quiet_optuna():  # heartbeats are experimental: no warning about it
            return RDBStorage(
                url,
                heartbeat_interval=HEARTBEAT_S,
                grace_period=2 * HEARTBEAT_S,
                heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1),
            )
    except Exception as exc:  # SQLAlchemy's errors, a driver's ImportError, Optuna's own
        raise LlmkitError(
            f"{where}: cannot open the study's database {shown_url(url)!r}: "
            f"{first_line(exc, typed=True, limit=300)}"
        ) from exc


def given_storage(
    search: SearchSpec, storage: str | None, path: str | Path
) -> tuple[str, str] | None:
    """The study's database URL given by ``--storage`` (first) or the search file, and where
    it was given; None for the default (``sqlite:///OUT/study.db``)."""
    if storage is not None:
        return storage, "--storage"
    if search.storage is not None:
        return search.storage, f"storage in {path}"
    return None


def _sqlite_inside(url: str, out: Path) -> bool:
    """Whether ``url`` is a SQLite database file inside the search's directory ``out`` (which
    is made before it is opened, as the default ``sqlite:///OUT/study.db`` is)."""
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
        if parsed.get_backend_name() != "sqlite" or not parsed.database:
            return False
        return Path(parsed.database).resolve().is_relative_to(out.resolve())
    except Exception:  # not a URL: open_storage says so
        return False


def open_given_storage(search: SearchSpec, storage: str | None, path: str | Path, out: Path) -> Any:
    """The storage ``--storage`` or the search file names, opened before the search's
    directory ``out`` is made (a one-line :class:`LlmkitError` when it cannot be), so that a
    refused URL leaves nothing behind; None for the default, and for a SQLite file inside
    ``out`` (opened once ``out`` is made)."""
    given = given_storage(search, storage, path)
    if given is None:
        return None
    if _sqlite_inside(given[0], out):
        problem = storage_problem(given[0])
        if problem:
            raise LlmkitError(f"{given[1]}: {problem}")
        return None
    return open_storage(*given)
