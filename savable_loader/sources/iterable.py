"""IterableSource: a user's generator function as a savable source, with an explicit position.

The user function ``fn(info)`` returns an iterable of the samples of one worker's
stream; ``info`` (a :class:`StreamInfo`) says which rank and worker it is for, the epoch
and the seed. **The function splits the stream**: each worker must get its own part
(``info.split(iterable)`` takes every ``info.num_global_workers``-th item from
``info.global_worker`` on, reading and dropping the others; a function that can jump
to its part, by file or by index, should do that instead).

The state is the epoch and ``position``, the number of samples this worker has taken
from its stream in this epoch. To continue from a position, the source calls
``seek(info, position)`` if given, which must return an iterable of the same stream
from sample ``position`` on; without ``seek`` it calls ``fn(info)`` again and discards
``position`` samples, warning with a :class:`ReplayWarning` that says how many.

Before taking each sample the source re-seeds Python ``random``, NumPy's and torch's
global RNGs from the sample's key (``mark_sample``), so random draws made by ``fn``
itself from those generators repeat on a resume. Restore key of a sample:
``[worker, position]``; ``restore_sample`` needs ``seek``.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from savable_loader.config import WorkerConfig, active_repetitions
from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import DataError, LoaderUsageError, RestoreKeyError

__all__ = ["IterableSource", "ReplayWarning", "StreamInfo"]


class ReplayWarning(UserWarning):
    """A source resumes by re-reading samples it had already produced (no way to seek).

    Example::

        warnings.simplefilter("error", ReplayWarning)   # refuse slow resumes in CI
    """


@dataclass(frozen=True)
class StreamInfo:
    """Where a stream is read: handed to the user functions of :class:`IterableSource`.

    Example::

        def lines(info):
            with open("data.txt") as f:
                yield from info.split(f)   # this worker's lines of the file
    """

    rank: int
    world_size: int
    worker: int
    workers_per_rank: int
    epoch: int
    repetitions: tuple[int, ...]
    seed: int

    @property
    def global_worker(self) -> int:
        """``rank * workers_per_rank + worker``: this worker's number among all."""
        return self.rank * self.workers_per_rank + self.worker

    @property
    def num_global_workers(self) -> int:
        """``world_size * workers_per_rank``: how many workers read the stream."""
        return self.world_size * self.workers_per_rank

    def split(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """This worker's items of ``iterable``: every ``num_global_workers``-th item from
        ``global_worker`` on (the others are read and dropped)."""
        return itertools.islice(iterable, self.global_worker, None, self.num_global_workers)


def stream_info(wc: WorkerConfig, worker: int | None = None, epoch: int | None = None) -> StreamInfo:
    """The :class:`StreamInfo` of the calling worker under ``wc`` (or of logical
    ``worker``, in ``epoch``): shared by the stream sources."""
    return StreamInfo(
        rank=wc.rank,
        world_size=wc.world_size,
        worker=wc.rank_worker_id() if worker is None else worker,
        workers_per_rank=wc.workers_per_rank,
        epoch=wc.active_epoch() if epoch is None else epoch,
        repetitions=active_repetitions(),
        seed=wc.seed,
    )


def is_index_pair(key: Any) -> bool:
    """``key`` is a list or tuple of two ints ``>= 0`` (bools excluded): the restore key
    shape of the stream sources."""
    return (
        isinstance(key, (list, tuple))
        and len(key) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in key)
    )


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


class IterableSource(SavableDataset):
    """A savable source over ``fn(info)``, resumed by ``seek(info, position)`` or by replay.

    Example::

        def numbers(info):                    # the whole stream, split by worker
            return info.split(range(1000))

        def numbers_from(info, position):     # the same stream from `position` on
            first = info.global_worker + position * info.num_global_workers
            return range(first, 1000, info.num_global_workers)

        ds = IterableSource(numbers, wc, seek=numbers_from)
    """

    _savable_fields = ("epoch", "position")

    def __init__(
        self,
        fn: Callable[[StreamInfo], Iterable[Any]],
        worker_config: WorkerConfig,
        *,
        seek: Callable[[StreamInfo, int], Iterable[Any]] | None = None,
    ) -> None:
        super().__init__(worker_config)
        if not callable(fn):
            raise LoaderUsageError(f"IterableSource fn must be callable, got {fn!r}")
        if seek is not None and not callable(seek):
            raise LoaderUsageError(f"IterableSource seek must be None or callable, got {seek!r}")
        self.fn = fn
        self.seek = seek
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.epoch = [self.worker_config.active_epoch(), *active_repetitions()]
        self.position = 0

    def info(self, worker: int | None = None) -> StreamInfo:
        """The :class:`StreamInfo` of the calling worker (or of logical ``worker``)."""
        return stream_info(self.worker_config, worker)

    def _open(self, what: str, call: Callable[[], Any]) -> Iterator[Any]:
        stream = call()
        try:
            return iter(stream)
        except TypeError:
            raise LoaderUsageError(
                f"IterableSource {what} must return an iterable, got {type(stream).__name__}"
            ) from None

    def __iter__(self) -> Iterator[Any]:
        info = self.info()
        start = self.position
        if start and self.seek is not None:
            seek = self.seek
            it = self._open(f"seek {_name(seek)}", lambda: seek(info, start))
        else:
            it = self._open(f"fn {_name(self.fn)}", lambda: self.fn(info))
            if start:
                warnings.warn(
                    ReplayWarning(
                        f"IterableSource({_name(self.fn)}): worker {info.worker} of rank {info.rank} resumes at "
                        f"sample {start} of its stream by replaying {start} samples through the function "
                        f"(no seek callback was given), which costs as long as producing them did; pass "
                        f"seek=... to jump there directly"
                    ),
                    stacklevel=2,
                )
                for i in range(start):
                    self.mark_sample([info.worker, i])
                    try:
                        next(it)
                    except StopIteration:
                        raise DataError(
                            f"IterableSource({_name(self.fn)}): worker {info.worker}'s stream ended after {i} "
                            f"samples while replaying to the saved position {start}; the stream changed"
                        ) from None
        while True:
            self.mark_sample([info.worker, self.position])
            try:
                sample = next(it)
            except StopIteration:
                return
            self.position += 1
            yield sample

    def restore_sample(self, key: Any) -> Any:
        """Sample ``[worker, position]``: the first sample of ``seek(info, position)``."""
        reason = self.restore_sample_blocker()
        if reason is not None:
            raise RestoreKeyError(reason)
        if not is_index_pair(key):
            raise RestoreKeyError(f"IterableSource key must be [worker, position], got {key!r}")
        worker, position = key
        if worker >= self.worker_config.workers_per_rank:
            raise RestoreKeyError(
                f"IterableSource key {key!r}: worker {worker} is not in [0, {self.worker_config.workers_per_rank})"
            )
        info = self.info(worker)
        seek = self.seek
        it = self._open(f"seek {_name(seek)}", lambda: seek(info, position))  # type: ignore[misc]
        self.mark_sample([worker, position])
        try:
            return next(it)
        except StopIteration:
            raise RestoreKeyError(
                f"IterableSource key {key!r}: seek {_name(seek)} returned an empty stream at position {position}"
            ) from None

    def restore_sample_blocker(self) -> str | None:
        if self.seek is None:
            return (
                f"IterableSource({_name(self.fn)}) has no seek callback, so it cannot build one sample alone "
                "(pass seek=lambda info, position: <the stream from position on>)"
            )
        return None

    def config(self) -> dict[str, Any]:
        return {"fn": self.fn}
