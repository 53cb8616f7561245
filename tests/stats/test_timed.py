"""The timed iterators of ``stats/timed.py``, on a clock the test moves: exceptions in
inner stages, iterators that go on after an exception, ``close()``, nothing wrapped
outside an active clock, ``activate`` per thread, ``super().__iter__()`` as one stage,
and the hand-over of a settled clock's stages to the datasets' own iterators."""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest

import savable_loader as sl
from savable_loader.pipeline.worker import walk
from savable_loader.stats.clock import StageClock
from savable_loader.stats.timed import Handover, activate, active_clock, parts_of
from savable_loader.wrappers import (
    BatchDataset,
    ConcatDataset,
    FilterDataset,
    GcDataset,
    LimitDataset,
    MapDataset,
    ShuffleBufferDataset,
)
from tests.stats.clock_helpers import WC, Source, Wrapper, sleeper, stages, timed_run


def test_an_exception_in_an_inner_stage_keeps_the_accounts(fake):
    class Failing(sl.SavableDataset):
        def __init__(self) -> None:
            super().__init__(WC)

        def __iter__(self):
            fake.sleep(2.0)
            yield 0
            fake.sleep(3.0)
            raise ValueError("bad sample")

        def config(self) -> dict[str, Any]:
            return {}

    class Catching(Wrapper):
        def __iter__(self):
            it = iter(self.inner)
            for _ in range(2):
                fake.sleep(1.0)
                try:
                    value = next(it)
                except ValueError:
                    value = "caught"
                yield value

    class Passing(Wrapper):
        def __iter__(self):
            for value in self.inner:
                fake.sleep(7.0)
                yield value

    clock = StageClock()
    caught = Catching(Failing())
    clock.name_stages(walk(caught))
    assert timed_run(clock, caught) == [0, "caught"]
    assert stages(clock) == {"Catching": (pytest.approx(2.0), 2, False), "Failing": (pytest.approx(5.0), 1, True)}
    passing = Passing(Failing())
    clock.name_stages(walk(passing))
    with activate(clock), pytest.raises(ValueError, match="bad sample"):
        list(iter(passing))
    assert stages(clock) == {"Passing": (pytest.approx(7.0), 1, False), "Failing": (pytest.approx(5.0), 1, True)}
    # the clock goes on exact after exceptions went through its stages
    ds = MapDataset(Source(3, fake, cost=1.0), sleeper(fake, 2.0))
    clock.name_stages(walk(ds))
    assert timed_run(clock, ds) == [0, 1, 2]
    assert stages(clock) == {
        "MapDataset(step)": (pytest.approx(6.0), 3, False),
        "Source": (pytest.approx(3.0), 3, True),
    }


class GoesOn:
    """An iterator (not a generator) that raises for its items ``bad`` (default: the 3rd)
    and goes on, as torch allows an IterableDataset's iterator to (the loader raises that
    batch's error, and the next ``next()`` gets the next batch)."""

    def __init__(self, n: int, bad: tuple[int, ...] = (2,)) -> None:
        self.i, self.n, self.bad = 0, n, bad
        self.closed = False
        self.label = "goes on"

    def __iter__(self):
        return self

    def __next__(self) -> int:
        i = self.i
        self.i += 1
        if i >= self.n:
            raise StopIteration
        if i in self.bad:
            raise ValueError(f"item {i}")
        return i

    def close(self) -> None:
        self.closed = True


def test_an_iterator_that_goes_on_after_an_exception_goes_on_when_timed(fake):
    clock = StageClock()
    src = Source(1, fake)
    it = clock.wrap(src, GoesOn(5))
    assert it.label == "goes on"  # type: ignore[attr-defined]  # (its other attributes are its own)
    got = []
    while True:
        try:
            got.append(next(it))
        except ValueError as e:
            got.append(str(e))
        except StopIteration:
            break
    assert got == [0, 1, "item 2", 3, 4]
    assert stages(clock)["Source"][1] == 4


def test_close_reaches_the_dataset_iterator(fake):
    closed: list[str] = []

    class Closing(sl.SavableDataset):
        def __init__(self) -> None:
            super().__init__(WC)

        def __iter__(self):
            try:
                yield from range(10)
            finally:
                closed.append("closed")

        def config(self) -> dict[str, Any]:
            return {}

    clock = StageClock()
    ds = Closing()
    with activate(clock):
        it = iter(ds)
        assert next(it) == 0
        assert next(it) == 1
    it.close()
    assert closed == ["closed"]
    assert stages(clock)["Closing"][1] == 2
    # an iterator that is not a generator is closed too, even before its first item
    inner = GoesOn(3)
    wrapped = clock.wrap(ds, inner)
    wrapped.close()  # type: ignore[attr-defined]
    assert inner.closed


def test_outside_an_active_clock_nothing_is_wrapped(fake):
    src = Source(3, fake)
    assert active_clock() is None
    it = iter(src)
    assert type(it) is types.GeneratorType
    assert it.gi_code is Source.__iter__.__wrapped__.__code__  # the dataset's own generator
    assert list(it) == [0, 1, 2]
    ds = MapDataset(src, sleeper(fake, 1.0))
    with activate(None):
        it = iter(ds)
        assert it.gi_code is MapDataset.__iter__.__wrapped__.__code__
    clock = StageClock()
    with activate(clock):
        assert active_clock() is clock
        wrapped = iter(src)
        # timed: a Handover (its timing wrapper first) over the dataset's own generator
        assert type(wrapped) is Handover
        assert type(wrapped.inner) is types.GeneratorType  # type: ignore[attr-defined]
        assert wrapped.inner.gi_code is Source.__iter__.__wrapped__.__code__  # type: ignore[attr-defined]
        assert list(wrapped) == [0, 1, 2]
    assert active_clock() is None
    assert stages(clock)["Source"] == (pytest.approx(3.0), 3, True)


def test_activate_nests_and_is_per_thread():
    outer, inner = StageClock(), StageClock()
    seen: list[Any] = []
    with activate(outer):
        with activate(inner):
            assert active_clock() is inner
            thread = threading.Thread(target=lambda: seen.append(active_clock()))
            thread.start()
            thread.join()
        assert active_clock() is outer
        with activate(None):
            assert active_clock() is None
        assert active_clock() is outer
    assert active_clock() is None
    assert seen == [None]


def test_a_subclass_calling_super_iter_is_one_stage(fake):
    class Doubled(Source):
        def __iter__(self):
            for value in super().__iter__():
                yield 2 * value

    class Returned(Source):
        def __iter__(self):
            return super().__iter__()

    for cls, want in ((Doubled, [0, 2, 4]), (Returned, [0, 1, 2])):
        ds = cls(3, fake, cost=1.0)
        clock = StageClock()
        clock.name_stages(walk(ds))
        assert timed_run(clock, ds) == want
        assert stages(clock) == {cls.__name__: (pytest.approx(3.0), 3, True)}
        assert clock.samples() == 3


class Restarting:
    """An iterator (not a generator) that, asked again after its StopIteration, starts
    over; counts the ``next()`` calls it gets."""

    def __init__(self, n: int) -> None:
        self.i, self.n, self.calls = 0, n, 0

    def __iter__(self):
        return self

    def __next__(self) -> int:
        self.calls += 1
        i = self.i
        if i >= self.n:
            self.i = 0
            raise StopIteration
        self.i += 1
        return i


def drain(it, clock: StageClock | None = None, settle_at: int | None = None) -> list[Any]:
    """What ``next(it)`` gives until StopIteration: values, and the ValueErrors raised as
    ``"raised <message>"``; ``clock`` settles before the ``settle_at``-th ``next()``."""
    got: list[Any] = []
    while True:
        if clock is not None and len(got) == settle_at:
            clock.settled = True
        try:
            got.append(next(it))
        except ValueError as e:
            got.append(f"raised {e}")
        except StopIteration:
            return got


def counted(clock: StageClock) -> dict[str, tuple[float, int]]:
    """Each stage's own seconds and items the clock counted since its last take()."""
    return {slot[0]: (slot[1], slot[2]) for slot in clock._slots.values()}


def test_a_handover_over_a_generator_passes_items_through_once_settled(fake):
    def pipeline():
        return MapDataset(Source(10, fake, cost=1.0), sleeper(fake, 2.0))

    unwrapped = list(iter(pipeline()))  # (no active clock)
    assert unwrapped == list(range(10))
    ds = pipeline()
    clock = StageClock()
    clock.name_stages(walk(ds))
    start = fake.now
    with activate(clock):
        it = iter(ds)
        assert type(it) is Handover
        assert it.inner.gi_code is MapDataset.__iter__.__wrapped__.__code__  # type: ignore[attr-defined]
        got = [next(it) for _ in range(4)]
        assert counted(clock) == {"MapDataset(step)": (pytest.approx(8.0), 4), "Source": (pytest.approx(4.0), 4)}
        clock.settled = True
        # the rest straight from the datasets' own generators: the stream unchanged, nothing counted
        got += list(it)
        with pytest.raises(StopIteration):
            next(it)
    assert got == unwrapped
    assert counted(clock) == {"MapDataset(step)": (pytest.approx(8.0), 4), "Source": (pytest.approx(4.0), 4)}
    assert fake.now == start + 10 * 3.0  # (each item made once)


@pytest.mark.parametrize("settle_at", [None, 0, 2, 3, 6, 9, 11])
def test_a_handover_over_an_iterator_that_goes_on_after_exceptions_goes_on_before_and_after_settling(fake, settle_at):
    want = drain(GoesOn(11, bad=(2, 3, 8)))
    assert want == [0, 1, "raised item 2", "raised item 3", 4, 5, 6, 7, "raised item 8", 9, 10]
    clock = StageClock()
    inner = GoesOn(11, bad=(2, 3, 8))
    it = clock.wrap(Source(0, fake), inner)
    assert type(it) is Handover and it.inner is inner  # type: ignore[attr-defined]
    assert drain(it, clock, settle_at) == want
    # the items it yielded timed: those before it settled
    before = want if settle_at is None else want[:settle_at]
    assert counted(clock)["Source"][1] == sum(type(v) is int for v in before)
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("settle_at", [None, 0, 2, 4])
def test_an_iterator_that_ended_is_not_asked_again(fake, settle_at):
    plain = Restarting(4)
    assert drain(plain) == [0, 1, 2, 3]
    assert next(plain) == 0  # (unwrapped, it would start over)
    clock = StageClock()
    inner = Restarting(4)
    it = clock.wrap(Source(0, fake), inner)
    assert drain(it, clock, settle_at) == [0, 1, 2, 3]
    for _ in range(3):
        with pytest.raises(StopIteration):
            next(it)
    assert inner.calls == 5  # 4 items and one StopIteration


def test_parts_of_an_untimed_dataset_is_its_own_iterator(fake):
    ds = Source(3, fake)
    (part,) = parts_of(ds)  # (no active clock)
    assert type(part) is types.GeneratorType and part.gi_code is Source.__iter__.__wrapped__.__code__
    assert list(part) == [0, 1, 2]


#: The wrappers that loop over their input through ``parts_of``, each over a Source.
LOOPING: dict[str, Any] = {
    "map": lambda src: MapDataset(src, lambda x: 10 * x),
    "filter": lambda src: FilterDataset(src, lambda x: x % 3 != 1),
    "batch": lambda src: BatchDataset(src, 4, collate_fn=list),
    "limit": lambda src: LimitDataset(src, 17),
    "concat": lambda src: ConcatDataset([src]),
    "gc": lambda src: GcDataset(src, 5, generation=0, freeze=False),
    "shuffle_buffer": lambda src: ShuffleBufferDataset(src, size=4),
}


def own_generator_looped(generator: Any) -> bool:
    """Whether the suspended generator of a wrapper loops over the Source's own
    generator (a local of its frame), not over a Handover."""
    code = Source.__iter__.__wrapped__.__code__
    return any(
        type(v) is types.GeneratorType and v.gi_code is code for v in generator.gi_frame.f_locals.values()
    ) and not any(type(v) is Handover for v in generator.gi_frame.f_locals.values())


@pytest.mark.parametrize("settle_at", [None, 0, 1, 3])
@pytest.mark.parametrize("name", sorted(LOOPING))
def test_a_looping_wrapper_loops_over_its_inputs_own_iterator_once_settled(fake, name, settle_at):
    """A wrapper of ``savable_loader.wrappers`` loops over its input through
    ``parts_of``: the same stream whenever the clock settles, the items before it timed,
    and after it the input's own generator looped over directly (no Handover per item)."""
    make = LOOPING[name]
    want = list(iter(make(Source(30, fake, cost=1.0))))  # (no active clock)
    ds = make(Source(30, fake, cost=1.0))
    clock = StageClock()
    clock.name_stages(walk(ds))
    with activate(clock):
        it = iter(ds)
        assert type(it) is Handover
        got = drain_some(it, clock, settle_at, 4)
        if settle_at is not None:
            assert own_generator_looped(it.inner)  # type: ignore[attr-defined]
        got += drain(it, clock)
    assert got == want
    # the Source's items counted: all it made while timed, none once settled
    pulled = 17 if name == "limit" else 30
    timed_items = counted(clock)["Source"][1]
    if settle_at is None:
        assert timed_items == pulled
    elif settle_at == 0:
        assert timed_items == 0
    else:
        assert 0 < timed_items < pulled


def drain_some(it, clock: StageClock, settle_at: int | None, count: int) -> list[Any]:
    """The first ``count`` items of ``it``, ``clock`` settling before the ``settle_at``-th."""
    got: list[Any] = []
    for k in range(count):
        if k == settle_at:
            clock.settled = True
        got.append(next(it))
    return got


class Counting(sl.SavableDataset):
    """A source whose ``__iter__`` returns an iterator that is not a generator."""

    def __init__(self, n: int) -> None:
        super().__init__(WC)
        self.made: list[Restarting] = []
        self.n = n

    def __iter__(self):
        it = Restarting(self.n)
        self.made.append(it)
        return it

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


@pytest.mark.parametrize("settle_at", [None, 0, 2, 5])
def test_parts_of_an_iterator_that_is_not_a_generator_asks_it_again_only_if_handed_over(settle_at):
    """Over an iterator that is not a generator, ``parts_of`` goes on with the iterator
    itself only once the clock settled (an iterator that ended is not asked again: this
    one would start over)."""
    src = Counting(5)
    ds = MapDataset(src, lambda x: x + 100)
    clock = StageClock()
    clock.name_stages(walk(ds))
    with activate(clock):
        got = drain(iter(ds), clock, settle_at)
    assert got == [100, 101, 102, 103, 104]
    (inner,) = src.made
    assert inner.calls == 6  # 5 items and one StopIteration
