"""A pipeline stage's iterator, timed while a clock is active in its thread.

While a loading context makes an item, its :class:`~savable_loader.stats.clock.StageClock`
is the thread's *active* clock (:class:`activate`), and every ``iter()`` of a
:class:`~savable_loader.SavableDataset` made then (:func:`timed_iter`, applied to every
subclass's ``__iter__``) returns the clock's wrapper of its iterator
(``StageClock.wrap``): a :class:`Handover`, an ``itertools.chain`` whose first part
times each ``next()`` (:func:`timed` over a generator, a :class:`TimedIterator` over
any other iterator) and whose second part, once the clock settles, is the dataset's own
iterator, passed through in C. Outside an active clock ``iter()`` returns the dataset's
own iterator.

Once settled, a ``Handover`` still costs a C call per item (a few nanoseconds, a share
of a µs-sample pipeline's time). A stage that loops over its input can spare it:
``for part in parts_of(inner): for sample in part: ...`` loops over the timing wrapper,
then over the dataset's own iterator directly (:func:`parts_of`; the wrappers of
``savable_loader.wrappers`` that loop over their input do).

A timed ``next()`` adds its *own time* to its stage's slot, ``[name, seconds, items,
...]``: its time less that of the ``next()`` calls it made into the stages it pulls from
(the clock's ``child`` seconds), and counts the calls in ``clock.calls``; while the
clock's ``on`` is false (an item it does not time) it only counts the item.

Example::

    clock = StageClock(worker=0)
    with activate(clock):
        items = iter(pipeline)      # each stage's iterator a Handover
        sample = next(items)        # each stage's own time added to the clock
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

__all__ = ["Handover", "TimedIterator", "activate", "active_clock", "handover", "parts_of", "timed", "timed_iter"]

_now = time.perf_counter
_local = threading.local()


def handover(iterator: Iterator[Any], slot: list[Any], clock: Any) -> Handover:
    """``iterator`` timed into ``slot`` by ``clock`` (a ``StageClock``), in a
    :class:`Handover`: by a generator (:func:`timed`) while the clock times, the cheaper
    wrapper, when ``iterator`` is a generator (a generator ends at its first exception,
    and so does the wrapper), else by a :class:`TimedIterator`, which goes on after an
    exception as the iterator it wraps may (a torch IterableDataset's)."""
    phase: Iterator[Any]
    if isinstance(iterator, types.GeneratorType):
        phase = timed(iterator, slot, clock)
        out = Handover(phase, iterator)
    else:
        phase = TimedIterator(iterator, slot, clock)
        out = cast(Handover, Handover.from_iterable(_then(phase, iterator)))
    out.inner = iterator
    out.phase = phase
    return out


def parts_of(dataset: Iterable[Any]) -> Iterable[Iterator[Any]]:
    """The iterators whose items, one after the other, are ``iter(dataset)``'s: a
    :class:`Handover`'s timing wrapper, then the dataset's own iterator (for a stage that
    loops over its input, sparing the Handover's call per item once the clock settles;
    the timing wrapper ends early only then); any other iterator alone. Example::

        for part in parts_of(self.dataset):
            for sample in part:
                yield fn(sample)
    """
    iterator = iter(dataset)
    if type(iterator) is not Handover:
        return (iterator,)
    phase = iterator.phase
    if type(phase) is TimedIterator:
        return _then(phase, iterator.inner)
    return (phase, iterator.inner)


def timed(iterator: Iterator[Any], slot: list[Any], clock: Any) -> Iterator[Any]:
    """``iterator`` whose ``next()`` calls add their own time to ``slot`` (see the module
    docstring), until ``clock`` settles (then it returns, and its :class:`Handover` goes
    on with ``iterator``); closing it while it runs closes ``iterator``."""
    now = _now
    pull = iterator.__next__
    try:
        while not clock.settled:
            if clock.on:
                outer = clock.child
                clock.child = 0.0
                start = now()
                try:
                    value = pull()
                finally:
                    spent = now() - start
                    slot[1] += spent - clock.child
                    clock.child = outer + spent
                    clock.calls += 1
            else:
                value = pull()
            slot[2] += 1
            yield value
    except StopIteration:
        return
    except BaseException:  # closed, or the dataset's exception: its iterator is done with
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
        raise


class TimedIterator:
    """An iterator that is not a generator, timed as :func:`timed` times a generator
    until its clock settles (then it ends, ``handed_over`` set): an exception from its
    ``next()`` passes through and the iterator goes on."""

    __slots__ = ("_clock", "_it", "_slot", "handed_over")

    def __init__(self, iterator: Iterator[Any], slot: list[Any], clock: Any) -> None:
        self._it = iterator
        self._slot = slot
        self._clock = clock
        self.handed_over = False

    def __iter__(self) -> TimedIterator:
        return self

    def __next__(self) -> Any:
        clock, slot = self._clock, self._slot
        if clock.settled:
            self.handed_over = True
            raise StopIteration
        if not clock.on:
            value = next(self._it)
            slot[2] += 1
            return value
        outer = clock.child
        clock.child = 0.0
        start = _now()
        try:
            value = next(self._it)
        finally:
            spent = _now() - start
            slot[1] += spent - clock.child
            clock.child = outer + spent
            clock.calls += 1
        slot[2] += 1
        return value


def _then(phase: TimedIterator, iterator: Iterator[Any]) -> Iterator[Iterator[Any]]:
    """The parts of a :class:`Handover` over an iterator that is not a generator: the
    timed phase, then the iterator itself only if the phase handed it over (an iterator
    that ended is not asked again)."""
    yield phase
    if phase.handed_over:
        yield iterator


class Handover(itertools.chain[Any]):
    """A timed stage's iterator: its timing wrapper, then (once the clock settles) the
    dataset's own iterator, passed through in C. ``close()`` closes the dataset's
    iterator; its other attributes are the dataset iterator's."""

    __slots__ = ("inner", "phase")
    inner: Iterator[Any]
    #: the timing wrapper (see :func:`parts_of`)
    phase: Iterator[Any]

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "phase"):  # (not set yet)
            raise AttributeError(name)
        return getattr(self.inner, name)


def active_clock() -> Any:
    """The clock of the item the current thread is making, if any."""
    clock: Any = getattr(_local, "clock", None)
    return clock


class activate:
    """Make ``clock`` the current thread's active clock for a block (None: no clock)."""

    __slots__ = ("_clock", "_saved")

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._saved: Any = None

    def __enter__(self) -> None:
        self._saved = getattr(_local, "clock", None)
        _local.clock = self._clock

    def __exit__(self, *exc: object) -> None:
        _local.clock = self._saved


def timed_iter(method: Callable[[Any], Iterator[Any]]) -> Callable[[Any], Iterator[Any]]:
    """``method`` (a dataset class's ``__iter__``) returning its iterator wrapped by
    :func:`timed` while a clock is active, and the dataset's own iterator otherwise."""
    if getattr(method, "__timed__", False):
        return method

    # (it names only importable functions: cloudpickle copies a class of the user's
    # ``__main__`` by value, this function with it, to spawned workers)
    @functools.wraps(method)
    def __iter__(self: Any) -> Iterator[Any]:
        iterator = method(self)
        clock = active_clock()
        if clock is None:
            return iterator
        own = type(self).__iter__
        if own is not __iter__ and getattr(own, "__timed__", False):
            # super().__iter__() from a subclass's timed __iter__: the subclass's wrapper
            # times the stage (wrapped here too, its items would count twice)
            return iterator
        return clock.wrap(self, iterator)

    __iter__.__timed__ = True  # type: ignore[attr-defined]
    return __iter__
