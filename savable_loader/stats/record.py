"""What ``loader.stats()`` returns: where the step time went over a window of a run.

A :class:`LoaderStats` covers a window of one loader on one rank: from the previous
``stats()`` call or the start of the epoch, whichever is later, to the call. It is a
versioned msgspec struct: one line of JSON in the stats log (``stats_log=``), read back
by ``python -m savable_loader report``.

Example::

    s = loader.stats()
    print(s.summary())       # epoch 0 | 50 steps in 6.1 s | input wait 81% (input-bound) | ...
    bar.set_postfix(s.postfix())
    s.wait_share, s.slowest  # 0.81, 'MapDataset(augment)'
"""

from __future__ import annotations

from typing import Any

import msgspec

from savable_loader.errors import DataError

__all__ = ["STATS_VERSION", "LoaderStats", "QueueStats", "StageStats", "WorkerStats", "verdict"]

#: The version of :class:`LoaderStats` (its JSON form, a line of the stats log).
STATS_VERSION = 1

#: Wait shares at or above which a window is called input-bound / partly input-bound.
INPUT_BOUND = 0.5
PARTLY_INPUT_BOUND = 0.1


class WorkerStats(msgspec.Struct, frozen=True, kw_only=True):
    """One loading context over the window: ``worker`` (-1: the main process, when
    ``num_workers=0``; a pipeline's logical worker otherwise), ``items`` it delivered,
    ``samples`` in them, ``busy_seconds`` making them, and ``busy_share`` of the window."""

    worker: int
    items: int
    samples: int
    busy_seconds: float
    busy_share: float


class StageStats(msgspec.Struct, frozen=True, kw_only=True):
    """A stage's own time over the window, summed over the workers: ``name``, ``seconds``,
    ``items`` it yielded and ``share`` of all stages' time. Stages: each dataset of a
    savable pipeline (``MapDataset(augment)``, the source), ``collate`` and ``snapshot``;
    on the drop-in path the map-style dataset (its ``__getitem__``, the per-sample
    re-seeding included) and ``collate``."""

    name: str
    seconds: float
    items: int
    share: float


class QueueStats(msgspec.Struct, frozen=True, kw_only=True):
    """Items ready and waiting when the training loop asked for the next one: ``mean``
    and ``max`` over the window's ``next()`` calls, ``empty_share`` (the share of calls
    that found none ready: the loop waited), and ``series``, ``[seconds into the window,
    depth]`` for every call, or every second, fourth, ... call of a long window (between
    :data:`~savable_loader.stats.recorder.SERIES_POINTS` and twice as many points)."""

    mean: float
    max: int
    empty_share: float
    series: list[tuple[float, int]] = []


class LoaderStats(msgspec.Struct, frozen=True, kw_only=True):
    """Where one window of a run's step time went (see the module docstring).

    ``wait_share`` is the share of the window's wall time the training loop spent inside
    ``next(loader)``: near 0 when the loop is slower than the loader, near 1 when the
    loader keeps it waiting. ``slowest`` names the stage with the most own time.
    """

    version: int = STATS_VERSION
    rank: int = 0
    epoch: int = 0
    #: unix time at the end of the window (the log's clock)
    time: float = 0.0
    #: batches the loader yielded since it was built, at the end of the window
    step: int = 0
    seconds: float = 0.0
    steps: int = 0
    samples: int = 0
    wait_seconds: float = 0.0
    wait_share: float = 0.0
    steps_per_s: float = 0.0
    samples_per_s: float = 0.0
    workers: list[WorkerStats] = []
    queue: QueueStats | None = None
    stages: list[StageStats] = []
    slowest: str | None = None

    @property
    def verdict(self) -> str:
        """``input-bound``, ``partly input-bound`` or ``compute-bound``."""
        return verdict(self.wait_share)

    def summary(self) -> str:
        """One line for a training log::

        epoch 0 | 50 steps in 6.1 s | input wait 81% (input-bound) | 8.2 steps/s, 262 samples/s |
        workers busy 99% 98% | ready 0.0 (max 1) | slowest MapDataset(augment) 86%
        """
        parts = [
            f"epoch {self.epoch}",
            f"{self.steps} steps in {self.seconds:.3g} s",
            f"input wait {self.wait_share:.0%} ({self.verdict})",
            f"{self.steps_per_s:.3g} steps/s, {self.samples_per_s:.4g} samples/s",
        ]
        if self.workers:
            parts.append("workers busy " + " ".join(f"{w.busy_share:.0%}" for w in self.workers))
        if self.queue is not None:
            parts.append(f"ready {self.queue.mean:.1f} (max {self.queue.max})")
        if self.slowest is not None:
            share = next((s.share for s in self.stages if s.name == self.slowest), 0.0)
            parts.append(f"slowest {self.slowest} {share:.0%}")
        return " | ".join(parts)

    def postfix(self) -> dict[str, str]:
        """Short fields for a progress bar: ``tqdm_bar.set_postfix(stats.postfix())``."""
        out = {"wait": f"{self.wait_share:.0%}", "steps/s": f"{self.steps_per_s:.3g}"}
        if self.workers:
            busy = sum(w.busy_share for w in self.workers) / len(self.workers)
            out["busy"] = f"{busy:.0%}"
        if self.slowest is not None:
            out["slowest"] = self.slowest
        return out

    def to_json(self) -> str:
        """One line of JSON (the stats log's form)."""
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> LoaderStats:
        """A :class:`LoaderStats` from :meth:`to_json`'s line; ``DataError`` naming the
        field if the line is not one (or is of a newer version)."""
        try:
            head = msgspec.json.decode(text)
        except msgspec.DecodeError as e:
            raise DataError(f"not a stats line: {e}") from None
        if not isinstance(head, dict):
            raise DataError(f"a stats line is a JSON object, got {type(head).__name__}")
        version = head.get("version")
        if version != STATS_VERSION:
            raise DataError(f"stats line version is {version!r}, expected {STATS_VERSION}")
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.ValidationError as e:
            raise DataError(f"malformed stats line: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The stats as plain data (what :meth:`to_json` writes)."""
        out: dict[str, Any] = msgspec.json.decode(self.to_json())
        return out


def verdict(wait_share: float) -> str:
    """What a wait share says: ``input-bound`` (at least half the time in ``next()``),
    ``partly input-bound`` (at least a tenth) or ``compute-bound``."""
    if wait_share >= INPUT_BOUND:
        return "input-bound"
    if wait_share >= PARTLY_INPUT_BOUND:
        return "partly input-bound"
    return "compute-bound"
