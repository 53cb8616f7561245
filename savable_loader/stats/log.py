"""The stats log: a JSON-lines file of :class:`~savable_loader.stats.record.LoaderStats`.

``SavableDataLoader(..., stats_log="run/stats-{rank}.jsonl")`` appends a line every
``stats_log_every`` seconds (default 10) and at the end of each epoch; ``python -m
savable_loader report`` reads it. Every line carries its rank, so the ranks of a
distributed run may share one file or (``{rank}`` in the path) write one each. A line
is written with one ``write()`` on a file opened for appending, and the file is opened
for each line: a run that is killed leaves whole lines, and a forked worker holds no
descriptor of it.

A log that cannot be written (a full disk, a path that is a folder) warns once and is
then left alone: the training run goes on.

Example::

    for stats in read_log("run/stats-0.jsonl"):
        print(stats.summary())
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

from savable_loader.errors import DataError, LoaderUsageError
from savable_loader.stats.record import LoaderStats

__all__ = ["StatsLog", "log_path", "read_log"]


def log_path(path: str | os.PathLike[str], rank: int) -> Path:
    """The log's path for ``rank`` (``{rank}`` in ``path`` replaced);
    ``LoaderUsageError`` naming ``stats_log`` for a path that is not one."""
    if not isinstance(path, (str, os.PathLike)):
        raise LoaderUsageError(
            f"stats_log must be a path (str or os.PathLike) or None, got {path!r} ({type(path).__qualname__})"
        )
    text = os.fspath(path)
    if not text:
        raise LoaderUsageError("stats_log must be a path or None, got ''")
    return Path(text.replace("{rank}", str(rank)))


class StatsLog:
    """Appends :class:`LoaderStats` lines to ``path`` (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failed = False

    def __call__(self, stats: LoaderStats) -> None:
        if self.failed:
            return
        line = (stats.to_json() + "\n").encode()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        except OSError as e:
            self.failed = True
            warnings.warn(
                f"stats_log {str(self.path)!r} cannot be written ({type(e).__name__}: {e}): no more lines are written "
                "to it; the loader goes on",
                RuntimeWarning,
                stacklevel=2,
            )


def read_log(path: str | os.PathLike[str]) -> Iterator[LoaderStats]:
    """The lines of a stats log, in order. A line that is not a stats line raises
    ``DataError`` naming the file and the line number, except a last line without its
    newline (a run killed while writing it), which is skipped."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield LoaderStats.from_json(line)
        except DataError as e:
            if number == len(lines):  # no newline after it: cut by a kill mid-write
                continue
            raise DataError(f"{os.fspath(path)} line {number}: {e}") from None
