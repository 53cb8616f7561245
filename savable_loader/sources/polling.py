"""PollingSource: a stream that producers keep filling, read by index, exact across restarts.

The user function ``fetch(info, index)`` returns item ``index`` of this data-parallel
rank's stream (``info`` is a :class:`~savable_loader.sources.StreamInfo`: rank, world
size, worker, epoch, seed), or ``None`` when that item is not there yet (the source
polls again, after ``poll_interval`` seconds, doubling up to 1 s, back to
``poll_interval`` once an item arrives), or :data:`END` when the stream (the epoch)
ends at ``index``.

**The contract that makes resumes exact: the same ``(rank, epoch, index)`` gives the
same item, every time it is asked for, in any process** (and, once the stream has
ended at ``n``, :data:`END` for every ``index >= n``: with several workers, some ask
for indices past the end). A restore asks ``fetch`` again only for the items a worker
had fetched ahead but the training loop had not consumed: the source has the loader
snapshot the pipeline after every item it reads (``request_snapshot(force=True)``,
taken when the item leaves the pipeline: once per batch under a ``BatchDataset``), so
no consumed item is ever fetched again.

Worker ``w`` of ``K`` (per rank) fetches indices ``w, w + K, w + 2K, ...``; the loader
yields them in index order (its round robin). The state is per worker: ``position``,
the number of items it has handed out in this epoch; a restore jumps to index
``w + position * K`` (no replay). Before each call of ``fetch`` the global RNGs
(``random``, NumPy's, torch's) are re-seeded from the item's key ``[epoch, index]``
(``mark_sample``), so random draws in ``fetch`` and in the wrappers above repeat on a
resume and in ``restore_sample``, however many polls an item took.

``fetch`` runs only where items are read (in the worker processes, or in the main
process with ``num_workers=0``), so a client created on first use inside ``fetch`` (the
lazy-client pattern) works with fork, spawn and forkserver workers.

Example::

    def fetch(info, index):
        path = f"stream/{info.rank}/{info.epoch}/{index}.json"
        if os.path.exists(path):
            return json.load(open(path))
        return END if os.path.exists(f"stream/{info.rank}/{info.epoch}/end") else None

    ds = PollingSource(fetch, wc, poll_interval=0.05, timeout=600)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Final, final

from savable_loader.config import WorkerConfig, active_repetitions
from savable_loader.core.shutdown import worker_done_event
from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError, RestoreKeyError, StateError, StreamTimeoutError, UsageTypeError
from savable_loader.sources.iterable import StreamInfo, is_index_pair, stream_info

__all__ = ["END", "PollingSource"]

#: The longest wait between two polls of one index (the backoff's cap), in seconds.
MAX_POLL_INTERVAL = 1.0


@final
class _End:
    """The type of :data:`END`: one instance per process, kept by pickling and copying."""

    _instance: _End | None = None

    def __new__(cls) -> _End:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __reduce__(self) -> str:
        return "END"  # pickled by name: unpickles as this module's END, in any process

    def __repr__(self) -> str:
        return "END"


#: What ``fetch`` returns when its stream ends at the index asked for. Compare with ``is``.
END: Final = _End()


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _seconds(name: str, value: Any, what: str, *, upper: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageTypeError(f"PollingSource {name} must be {what}, got {value!r} of type {type(value).__name__}")
    if not math.isfinite(value) or value <= 0 or (upper is not None and value > upper):
        raise LoaderUsageError(f"PollingSource {name} must be {what}, got {value!r}")
    return float(value)


class PollingSource(SavableDataset):
    """A savable source over ``fetch(info, index)``: a producer's stream, read by index.

    ``fetch(info, index)`` returns the item at ``index`` of rank ``info.rank``'s stream
    in epoch ``info.epoch``, ``None`` while it is not there yet, or :data:`END` where
    the stream ends. **The same ``(rank, epoch, index)`` must give the same item** (and
    :data:`END` for every index at or past the end): that is what makes a resume exact.
    Processes with the same data-parallel rank (tensor or pipeline peers) therefore read
    identical items.

    ``poll_interval``: seconds between the first polls of an index not there yet
    (doubling after each miss, up to 1 s; in ``(0, 1]``). ``timeout``: seconds to wait
    for one index before raising :class:`~savable_loader.errors.StreamTimeoutError`
    (naming the rank, the index and the seconds waited; the loader's workers are shut
    down); ``None`` waits forever. It bounds the polling: a single call of ``fetch`` that
    blocks is the client's to bound (give it a timeout of its own).

    Worker ``w`` of ``K`` fetches ``w, w + K, ...``; a state records how many items each
    worker handed out, a restore continues at the next index (items fetched ahead but
    not consumed are fetched again). A state restores with another ``num_workers``
    (the saved workers go on, hosted, until the epoch ends), not on another world size
    (a :class:`~savable_loader.errors.ConfigMismatchError`: the index space belongs to
    the rank). Restore key of an item: ``[epoch, index]``; ``restore_sample`` fetches
    that index again.

    Example::

        def fetch(info, index):
            if index >= 1000:
                return END                        # an epoch of 1000 items
            return client.get(info.rank, index)   # None while the producer is behind

        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
        loader = sl.SavableDataLoader(PollingSource(fetch, wc, timeout=300), batch_size=None, worker_config=wc)
    """

    #: A sample this source has read may be gone later (the producer drops what was read,
    #: a trim): a buffer above it saves its samples, not their keys (``wrappers._held``).
    samples_may_vanish: ClassVar[bool] = True

    _savable_fields = ("epoch", "position")

    def __init__(
        self,
        fetch: Callable[[StreamInfo, int], Any],
        worker_config: WorkerConfig,
        *,
        poll_interval: float = 0.05,
        timeout: float | None = None,
    ) -> None:
        super().__init__(worker_config)
        if not callable(fetch):
            raise UsageTypeError(
                f"PollingSource fetch must be callable as fetch(info, index), got {fetch!r} of type "
                f"{type(fetch).__name__}"
            )
        self.fetch = fetch
        self.poll_interval = _seconds(
            "poll_interval",
            poll_interval,
            f"a finite number of seconds in (0, {MAX_POLL_INTERVAL:g}]",
            upper=MAX_POLL_INTERVAL,
        )
        self.timeout = (
            None
            if timeout is None
            else _seconds("timeout", timeout, "None (wait forever) or a finite number of seconds > 0")
        )
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.epoch = [self.worker_config.active_epoch(), *active_repetitions()]
        self.position = 0

    def info(self, worker: int | None = None, epoch: int | None = None) -> StreamInfo:
        """The :class:`StreamInfo` of the calling worker (or of logical ``worker``, in ``epoch``)."""
        return stream_info(self.worker_config, worker, epoch)

    def __iter__(self) -> Iterator[Any]:
        info = self.info()
        if isinstance(self.position, bool) or not isinstance(self.position, int) or self.position < 0:
            raise StateError(
                f"PollingSource position must be an int >= 0 (the items this worker handed out), got {self.position!r}"
            )
        while True:
            index = info.worker + self.position * info.workers_per_rank
            item = self._wait(info, index)
            if item is END:
                return
            # a snapshot right after this item (forced: the producer may have dropped what
            # was consumed), so that a restore never fetches a consumed item again
            self.request_snapshot(force=True)
            self.position += 1
            yield item

    def _wait(self, info: StreamInfo, index: int) -> Any:
        """Item ``index`` (or END): ``fetch`` until it is not None, backing off, up to ``timeout``."""
        key = [info.epoch, index]
        delay = self.poll_interval
        started = time.monotonic()
        while True:
            self.mark_sample(key)  # before every call: the item's draws do not depend on the polls
            try:
                item = self.fetch(info, index)
            except StopIteration:
                raise LoaderUsageError(
                    f"PollingSource fetch {_name(self.fetch)} raised StopIteration for index {index} of rank "
                    f"{info.rank}'s stream: return savable_loader.sources.END to end the stream"
                ) from None
            if item is not None:
                if isinstance(item, (str, bytes)) and item in ("END", b"END"):  # not a token "End" of a text
                    raise LoaderUsageError(
                        f"PollingSource fetch {_name(self.fetch)} returned {item!r} for index {index} of "
                        f"rank {info.rank}'s stream: return savable_loader.sources.END (compared by identity) to end "
                        "the stream; an item that is exactly the text END is refused as ambiguous"
                    )
                return item
            waited = time.monotonic() - started
            if self.timeout is not None and waited >= self.timeout:
                raise StreamTimeoutError(
                    f"PollingSource({_name(self.fetch)}): rank {info.rank} waited {waited:.2f} s for index {index} "
                    f"of its stream (epoch {info.epoch}, worker {info.worker} of {info.workers_per_rank}; "
                    f"timeout={self.timeout:g}): fetch returned None every time. Is the producer running? (With "
                    "several workers, fetch must return END for every index at or past the stream's end.)",
                    rank=info.rank,
                    position=index,
                    waited=waited,
                )
            pause = delay if self.timeout is None else min(delay, self.timeout - waited)
            done = worker_done_event()  # (None in the main process)
            if done is not None and (done.is_set() or done.wait(max(pause, 0.0))):
                return END  # the loader shuts its workers down: nothing more is wanted from this one
            if done is None:
                time.sleep(max(pause, 0.0))
            delay = min(delay * 2, MAX_POLL_INTERVAL)

    def restore_sample(self, key: Any) -> Any:
        """Item ``[epoch, index]``: ``fetch`` asked for it again (waiting as the stream does)."""
        if not is_index_pair(key):
            raise RestoreKeyError(f"PollingSource key must be [epoch, index] (ints >= 0), got {key!r}")
        epoch, index = key
        info = self.info(worker=index % self.worker_config.workers_per_rank, epoch=epoch)
        item = self._wait(info, index)
        if item is END:
            raise RestoreKeyError(
                f"PollingSource key {list(key)!r}: fetch {_name(self.fetch)} returned END for index {index} of rank "
                f"{info.rank}'s stream in epoch {epoch}, which was an item when the key was made: the stream changed"
            )
        return item

    def restore_sample_blocker(self) -> str | None:
        return None

    def config(self) -> dict[str, Any]:
        return {"fetch": self.fetch}
