"""``StageClock`` and the timed iterators, on a clock the test moves (``clock._now``):
each stage's own time (the inner stages' time left out, however they nest, exceptions
included), items and samples, ``close()``, iterators that go on after an exception,
nothing wrapped outside an active clock, stage names, the sampling of cheap items, the
hand-over of a settled clock's stages to the datasets' own iterators (``Handover``), and
what travels with each item (``made()``, ``replayed()``, the reports)."""

from __future__ import annotations

import functools
import threading
import types
from typing import Any

import pytest

import savable_loader as sl
from savable_loader.pipeline.worker import walk
from savable_loader.stats import clock as clock_module
from savable_loader.stats.clock import FLUSH_SECONDS, Handover, StageClock, activate, active_clock, stage_name
from savable_loader.wrappers import BatchDataset, MapDataset


class FakeTime:
    """``time.perf_counter()`` as the test moves it (``sleep``); each read may cost
    ``read_cost`` seconds."""

    def __init__(self, read_cost: float = 0.0) -> None:
        self.now = 1000.0
        self.read_cost = read_cost

    def __call__(self) -> float:
        self.now += self.read_cost
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def clear_costs() -> None:
    """Forget the clock-read and wrapper costs measured in this process (cached: measured
    again, on the clock ``_now`` is then, by the next ``StageClock``)."""
    clock_module._read_cost.cache_clear()
    clock_module._layer_cost.cache_clear()


def use_fake(monkeypatch: pytest.MonkeyPatch, t: FakeTime) -> FakeTime:
    """``t`` as the clock's ``_now``, its costs measured on it."""
    monkeypatch.setattr(clock_module, "_now", t)
    clear_costs()
    return t


@pytest.fixture(autouse=True)
def _costs_measured_anew():
    """No test sees costs measured on another test's clock, nor leaves its own behind
    (for later tests in this process)."""
    clear_costs()
    yield
    clear_costs()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    return use_fake(monkeypatch, FakeTime())  # (its costs forgotten after the test: above)


WC = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)


class Source(sl.SavableDataset):
    """The integers below ``n``, each costing ``cost`` seconds of ``fake`` time."""

    def __init__(self, n: int, fake: FakeTime, cost: float = 1.0) -> None:
        super().__init__(WC)
        self.n, self.fake, self.cost = n, fake, cost

    def __iter__(self):
        for i in range(self.n):
            self.fake.sleep(self.cost)
            yield i

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


class Wrapper(sl.SavableDataset):
    """A dataset over ``inner`` (a stage that is not a source)."""

    def __init__(self, inner: sl.SavableDataset) -> None:
        super().__init__(WC)
        self.inner = inner

    def children(self):
        return [self.inner]

    def config(self) -> dict[str, Any]:
        return {}


def sleeper(fake: FakeTime, cost: float):
    def step(x):  # (every sleeper is named `step`)
        fake.sleep(cost)
        return x

    return step


def stages(clock: StageClock) -> dict[str, tuple[float, int, bool]]:
    return {name: (seconds, items, source) for name, seconds, items, source in clock.take()}


def timed_run(clock: StageClock, dataset: sl.SavableDataset) -> list[Any]:
    with activate(clock):
        return list(iter(dataset))


def test_own_time_leaves_out_the_stages_pulled_from(fake):
    src = Source(12, fake, cost=1.0)
    ds = BatchDataset(MapDataset(src, sleeper(fake, 4.0)), 4)
    clock = StageClock()
    clock.name_stages(walk(ds))
    batches = timed_run(clock, ds)
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    got = stages(clock)
    assert got == {
        "BatchDataset": (pytest.approx(0.0), 3, False),
        "MapDataset(step)": (pytest.approx(48.0), 12, False),
        "Source": (pytest.approx(12.0), 12, True),
    }
    assert stages(clock) == {}  # take() starts anew


def test_own_time_when_a_stage_spends_time_around_its_pulls(fake):
    class Pairs(Wrapper):
        """Costs 0.5 before and 0.25 after each pull of two inner samples."""

        def __iter__(self):
            it = iter(self.inner)
            for a in it:
                fake.sleep(0.5)
                b = next(it)
                fake.sleep(0.25)
                yield a, b

    ds = Pairs(MapDataset(Source(6, fake, cost=2.0), sleeper(fake, 3.0)))
    clock = StageClock()
    clock.name_stages(walk(ds))
    assert timed_run(clock, ds) == [(0, 1), (2, 3), (4, 5)]
    assert stages(clock) == {
        "Pairs": (pytest.approx(3 * 0.75), 3, False),
        "MapDataset(step)": (pytest.approx(18.0), 6, False),
        "Source": (pytest.approx(12.0), 6, True),
    }


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


def test_stage_names(fake):
    def augment(x):
        return x

    src = Source(1, fake)
    assert stage_name(src) == "Source"
    assert stage_name(MapDataset(src, augment)) == "MapDataset(augment)"
    assert stage_name(MapDataset(src, lambda x: x)) == "MapDataset"
    assert stage_name(MapDataset(src, functools.partial(augment))) == "MapDataset"
    assert stage_name(BatchDataset(src, 2)) == "BatchDataset"
    assert stage_name(sl.sources.IterableSource(lambda info: [], WC)) == "IterableSource"

    def numbers(info):
        return []

    assert stage_name(sl.sources.IterableSource(numbers, WC)) == "IterableSource(numbers)"


def test_names_met_twice_are_numbered_outermost_first(fake):
    src = Source(4, fake, cost=1.0)
    ds = MapDataset(
        MapDataset(MapDataset(MapDataset(src, lambda x: x), lambda x: x), sleeper(fake, 2.0)), sleeper(fake, 3.0)
    )
    clock = StageClock()
    clock.name_stages(walk(ds))
    timed_run(clock, ds)
    assert stages(clock) == {
        "MapDataset(step)": (pytest.approx(12.0), 4, False),
        "MapDataset(step) #2": (pytest.approx(8.0), 4, False),
        "MapDataset": (pytest.approx(0.0), 4, False),
        "MapDataset #2": (pytest.approx(0.0), 4, False),
        "Source": (pytest.approx(4.0), 4, True),
    }


def test_a_dataset_met_unnamed_is_named_by_its_class(fake):
    clock = StageClock()
    it = clock.wrap(Source(0, fake), iter([1, 2]))
    assert list(it) == [1, 2]
    assert [(name, items, source) for name, _, items, source in clock.take()] == [("Source", 2, True)]


def test_steps_that_are_not_datasets(fake):
    clock = StageClock()
    clock.add("collate", 0.25)
    clock.add("collate", 0.5)
    clock.add("snapshot", 0.125, items=3)
    assert stages(clock) == {"collate": (0.75, 2, False), "snapshot": (0.125, 3, False)}


def test_samples_are_the_sources_items_since_the_last_report(fake):
    ds = BatchDataset(MapDataset(Source(10, fake), sleeper(fake, 0.0)), 4)
    clock = StageClock()
    clock.name_stages(walk(ds))
    counts = []
    with activate(clock):
        it = iter(ds)
        for _ in range(3):
            next(it)
            counts.append(clock.samples())
            if len(counts) == 2:
                clock.take()  # (stage times taken between reports: samples still counted once)
    assert counts == [4, 4, 2]
    assert clock.samples() == 0


def named(times) -> dict[str, tuple[float, int, bool]]:
    """Stage times (as a report carries them) by name."""
    return {name: (seconds, items, source) for name, seconds, items, source in times}


def make_item(clock: StageClock, it, fake: FakeTime, ready: float, seeding: float = 0.0, collate=None):
    """One item as the pipeline runtime makes it: ``seeding`` seconds of re-seeding, the
    pipeline's ``next()``, then ready at ``ready``; what :meth:`StageClock.made` returns."""
    begun = fake()
    fake.sleep(seeding)
    pulled = fake()
    next(it)
    made = fake()
    fake.now = ready
    return clock.made(begun, pulled, made, fake(), collate)


def test_reports_carry_the_stages_when_due_and_at_the_end(fake):
    ds = Source(5, fake, cost=0.01)
    start = fake.now
    clock = StageClock(worker=1)  # (the first report due FLUSH_SECONDS from now)
    clock.name_stages([ds])
    with activate(clock):
        it = iter(ds)
        # x FLUSH_SECONDS after the start: items carry their ready time until a report is due
        first = make_item(clock, it, fake, ready=start + 0.5 * FLUSH_SECONDS, seeding=0.002)
        second = make_item(clock, it, fake, ready=start + 1.0 * FLUSH_SECONDS, seeding=0.002, collate=0.004)
        third = make_item(clock, it, fake, ready=start + 1.2 * FLUSH_SECONDS, seeding=0.001)
        fake.now = start + 1.3 * FLUSH_SECONDS
        final = clock.report(fake.now, final=True)
    assert first == start + 0.5 * FLUSH_SECONDS
    # the report covers both items made since the clock began, the one it travels with included
    worker, done_at, items, busy, samples, times = second
    assert (worker, done_at, items, samples) == (1, start + FLUSH_SECONDS, 2, 2)
    assert busy == pytest.approx(FLUSH_SECONDS)  # begun at the start, the 2nd ready FLUSH_SECONDS later
    assert type(times) is tuple
    assert named(times) == {
        "Source": (pytest.approx(0.02), 2, True),
        "seeding": (pytest.approx(0.004), 2, False),
        "collate": (0.004, 1, False),  # (only the item that went through a collate function)
    }
    assert third == start + 1.2 * FLUSH_SECONDS  # the last report less than FLUSH_SECONDS ago
    worker, done_at, items, busy, samples, times = final
    assert (worker, done_at, items, samples) == (1, None, 1, 1)
    assert busy == pytest.approx(0.2 * FLUSH_SECONDS)
    assert named(times) == {"Source": (pytest.approx(0.01), 1, True), "seeding": (pytest.approx(0.001), 1, False)}
    # nothing since: an empty report, its stages an empty tuple
    assert clock.report(fake.now, final=True) == (1, None, 0, 0.0, 0, ())


def test_made_returns_the_ready_time_or_nothing_until_a_report_is_due(fake):
    for stamp, worker in ((True, 3), (False, -1)):
        start = fake.now
        clock = StageClock(worker=worker, stamp=stamp)
        sent = []
        for k in range(4):  # ready at 0.3, 0.6, 0.9 and 1.2 x FLUSH_SECONDS after the start
            begun = fake.now
            fake.now = start + 0.3 * (k + 1) * FLUSH_SECONDS
            sent.append(clock.made(begun, begun, begun, fake.now))
        assert sent[:3] == ([start + 0.3 * (k + 1) * FLUSH_SECONDS for k in range(3)] if stamp else [None] * 3)
        worker_, done_at, items, busy, samples, times = sent[3]
        assert (worker_, done_at, items, samples) == (worker, start + 1.2 * FLUSH_SECONDS, 4, 0)
        assert busy == pytest.approx(1.2 * FLUSH_SECONDS)
        assert named(times) == {"seeding": (0.0, 4, False)}
        # the next report is due FLUSH_SECONDS after this one
        fake.now += 0.9 * FLUSH_SECONDS
        assert clock.made(fake.now, fake.now, fake.now, fake.now) == (fake.now if stamp else None)
        fake.now += 0.1 * FLUSH_SECONDS
        assert type(clock.made(fake.now, fake.now, fake.now, fake.now)) is tuple


def test_replayed_items_count_in_busy_and_seeding_not_in_items(fake):
    clock = StageClock(worker=2)
    t = fake.now
    clock.replayed(t, t + 0.1, t + 0.5)  # re-seeded 0.1 s, 0.4 s in the pipeline: made, not sent
    clock.replayed(t + 0.5, t + 0.7, t + 1.0)
    fake.now = t + 2.5
    report = clock.made(t + 1.0, t + 1.25, t + 2.0, ready=t + 2.5)  # (due: a report)
    worker, done_at, items, busy, samples, times = report
    assert (worker, done_at, items, samples) == (2, t + 2.5, 1, 0)
    assert busy == pytest.approx(0.5 + 0.5 + 1.5)
    assert named(times) == {"seeding": (pytest.approx(0.1 + 0.2 + 0.25), 3, False)}
    # replayed alone: their time goes with the next report, no item
    clock.replayed(t + 2.5, t + 2.75, t + 3.0)
    worker, done_at, items, busy, samples, times = clock.report(t + 3.0, final=True)
    assert (worker, done_at, items, samples) == (2, None, 0, 0)
    assert busy == pytest.approx(0.5)
    assert named(times) == {"seeding": (pytest.approx(0.25), 1, False)}


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


def run_items(clock: StageClock, fake: FakeTime, dataset: sl.SavableDataset, n: int):
    """Make ``n`` items as the pipeline runtime does (``made()`` after each, a final
    report); whether each was timed, the reports, and the busy seconds of the items."""
    timed_items: list[bool] = []
    reports = []
    busy = 0.0
    with activate(clock):
        it = iter(dataset)
        for _ in range(n):
            timed_items.append(clock.on)  # (decided when the item before was made)
            begun = fake()
            pulled = fake()
            next(it)
            made = fake()
            ready = fake()
            busy += ready - begun
            sent = clock.made(begun, pulled, made, ready)
            if type(sent) is tuple:
                assert sent[1] == ready
                reports.append(sent)
            else:
                assert sent == ready
        reports.append(clock.report(fake(), final=True))
    return timed_items, reports, busy


def summed(reports) -> tuple[int, float, int, dict[str, list[Any]]]:
    """The items, busy seconds and samples the reports carried, and their stage times
    (name -> [seconds, items])."""
    items, busy, samples = 0, 0.0, 0
    totals: dict[str, list[Any]] = {}
    for _, _, n, seconds, count, times in reports:
        items += n
        busy += seconds
        samples += count
        for name, spent, made, _ in times:
            slot = totals.setdefault(name, [0.0, 0])
            slot[0] += spent
            slot[1] += made
    return items, busy, samples, totals


def test_every_item_is_timed_when_the_budget_allows(monkeypatch):
    fake = use_fake(monkeypatch, FakeTime(read_cost=1e-9))  # 2 pulls: 4e-9 s, far less than 0.3 % of 2 ms
    n = 120  # (0.24 s: reports due twice, and the final one)
    ds = MapDataset(Source(n, fake, cost=1e-3), sleeper(fake, 1e-3))
    clock = StageClock()
    clock.name_stages(walk(ds))
    timed_items, reports, busy = run_items(clock, fake, ds, n)
    assert all(timed_items)
    assert [r[1] is None for r in reports] == [False, False, True]
    items, reported_busy, samples, totals = summed(reports)
    assert (items, samples) == (n, n)
    assert reported_busy == pytest.approx(busy, rel=1e-9)
    assert totals["MapDataset(step)"] == [pytest.approx(n * 1e-3, rel=1e-3), n]
    assert totals["Source"] == [pytest.approx(n * 1e-3, rel=1e-3), n]
    assert totals["seeding"] == [pytest.approx(n * 1e-9, rel=1e-3), n]


def test_cheap_items_are_timed_in_a_sample_and_scaled(monkeypatch):
    """When timing every item would cost more than TIMING_BUDGET of the pipeline's time,
    some items are not timed; items are counted exactly, and the stage times scaled to
    all items."""
    fake = use_fake(monkeypatch, FakeTime(read_cost=1e-7))
    monkeypatch.setattr(clock_module, "TIMING_BUDGET", 1e-5)  # 4 reads: 0.04 s of items, 1 item in 10
    n = 60
    ds = MapDataset(Source(n, fake, cost=1e-3), sleeper(fake, 3e-3))
    clock = StageClock()
    clock.name_stages(walk(ds))
    timed_items, reports, busy = run_items(clock, fake, ds, n)
    assert timed_items == ([True] + [False] * 9) * 6
    assert not clock.settled
    assert len(reports) == 3
    items, reported_busy, samples, totals = summed(reports)
    assert (items, samples) == (n, n)
    assert reported_busy == pytest.approx(busy, rel=1e-9)
    assert totals["MapDataset(step)"] == [pytest.approx(n * 3e-3, rel=0.01), n]
    assert totals["Source"] == [pytest.approx(n * 1e-3, rel=0.01), n]
    assert totals["seeding"][1] == n


def test_a_clock_whose_wrappers_cost_too_much_settles_and_divides_the_time(monkeypatch):
    """Where even an untimed wrapper costs more than the budget, the clock settles after
    PROBE_ITEMS items: the stages' time and items are the pipeline's divided in the
    proportions measured until then."""
    fake = use_fake(monkeypatch, FakeTime(read_cost=1e-9))
    monkeypatch.setattr(clock_module, "TIMING_BUDGET", 2e-7)
    n = 4 * clock_module.PROBE_ITEMS
    ds = MapDataset(Source(n, fake, cost=1e-3), sleeper(fake, 3e-3))
    clock = StageClock()
    clock.name_stages(walk(ds))
    timed_items, reports, busy = run_items(clock, fake, ds, n)
    assert clock.settled
    # (timed 1 item in so many at this budget) settled at the end of the first probe window
    probe = clock_module.PROBE_ITEMS
    assert timed_items[0] and not any(timed_items[probe:])
    assert len(reports) == 3
    items, reported_busy, samples, totals = summed(reports)
    assert (items, samples) == (n, n)
    assert reported_busy == pytest.approx(busy, rel=1e-9)
    assert totals["MapDataset(step)"][0] == pytest.approx(n * 3e-3, rel=0.02)
    assert totals["Source"][0] == pytest.approx(n * 1e-3, rel=0.02)
    assert totals["MapDataset(step)"][1] == totals["Source"][1] == totals["seeding"][1] == n


def settled_run(monkeypatch, inline: bool, replays: int = 0):
    """Make 200 items of known costs as the pipeline runtime does: ``replays`` of them
    replayed first, a snapshot (5 ms) every 40th, the clock settling after the first
    probe window. ``inline``: once settled, the runtime's own additions to the clock's
    counters (``WorkerRuntime.run``) instead of ``made()``/``replayed()``. The reports,
    and the true seconds of each step."""
    fake = use_fake(monkeypatch, FakeTime(read_cost=1e-9))
    monkeypatch.setattr(clock_module, "TIMING_BUDGET", 2e-7)  # (settles: see above)
    n = 200
    ds = MapDataset(Source(n, fake, cost=1e-3), sleeper(fake, 3e-3))
    clock = StageClock(worker=4)
    clock.name_stages(walk(ds))
    reports: list[Any] = []
    truth = {"seeding": 0.0, "collate": 0.0, "snapshot": 0.0, "busy": 0.0}
    with activate(clock):
        it = iter(ds)
        for k in range(n):
            begun = fake()
            fake.sleep(0.5e-3)  # re-seeding
            pulled = fake()
            next(it)
            made = collating = mark = fake()
            truth["seeding"] += pulled - begun
            replay = k < replays  # (a replayed item is neither snapshotted nor collated)
            if k % 40 == 39 and not replay:
                fake.sleep(5e-3)
                snapped = fake()
                clock.add("snapshot", snapped - mark)
                truth["snapshot"] += snapped - mark
                collating = mark = snapped
            if not replay:
                fake.sleep(2e-3)
                mark = fake()
                truth["collate"] += mark - collating
            truth["busy"] += mark - begun
            if inline and clock.settled:
                clock.busy += mark - begun
                if replay:
                    clock.replays += 1
                else:
                    clock.sent += 1
                    report = clock.report(mark) if mark >= clock.due else mark if clock.stamp else None
                    if type(report) is tuple:
                        reports.append(report)
            elif replay:
                clock.replayed(begun, pulled, made)
            else:
                report = clock.made(begun, pulled, made, mark, mark - collating)
                if type(report) is tuple:
                    reports.append(report)
        reports.append(clock.report(fake(), final=True))
    assert clock.settled
    return reports, truth


@pytest.mark.parametrize("inline", [False, True])
def test_a_settled_clock_divides_the_items_time_among_seeding_stages_and_collate(monkeypatch, inline):
    """Once settled, each item's busy seconds (the snapshots, still timed, left out) are
    divided among the re-seeding, the stages and the collate function in the proportions
    measured until then; the items, the busy seconds and the snapshots stay exact, and
    the runtime's own additions to the counters report what ``made()`` reports."""
    reports, truth = settled_run(monkeypatch, inline)
    assert len(reports) > 3  # (reports due every FLUSH_SECONDS of the 1.3 s run, and the final one)
    items, busy, samples, totals = summed(reports)
    assert (items, samples) == (200, 200)
    assert busy == pytest.approx(truth["busy"], rel=1e-9)
    assert totals["snapshot"] == [pytest.approx(truth["snapshot"], rel=1e-9), 5]
    assert totals["seeding"] == [pytest.approx(truth["seeding"], rel=0.01), 200]
    assert totals["collate"] == [pytest.approx(truth["collate"], rel=0.01), 200]
    assert totals["MapDataset(step)"] == [pytest.approx(200 * 3e-3, rel=0.01), 200]
    assert totals["Source"] == [pytest.approx(200 * 1e-3, rel=0.01), 200]
    # the whole: every second of the items is in a step (the reads between them aside)
    steps = sum(seconds for seconds, _ in totals.values())
    assert steps == pytest.approx(truth["busy"], rel=1e-3)


@pytest.mark.parametrize("inline", [False, True])
def test_a_settled_clock_counts_replayed_items_in_busy_not_in_items(monkeypatch, inline):
    """A restored worker's replay that goes on after the clock settled: the replayed
    items' seconds are busy time and divided among the steps, the items are not sent."""
    reports, truth = settled_run(monkeypatch, inline, replays=60)
    items, busy, samples, totals = summed(reports)
    assert items == 140  # (sent: the 200 made, less the 60 replayed)
    assert samples == 200  # (what the source read, the replay included)
    assert busy == pytest.approx(truth["busy"], rel=1e-9)
    assert totals["snapshot"] == [pytest.approx(truth["snapshot"], rel=1e-9), 4]
    assert totals["seeding"] == [pytest.approx(truth["seeding"], rel=0.01), 200]
    assert totals["Source"][0] == pytest.approx(200 * 1e-3, rel=0.01)
    steps = sum(seconds for seconds, _ in totals.values())
    assert steps == pytest.approx(truth["busy"], rel=1e-3)


def test_a_settled_clock_with_no_time_measured_divides_nothing(fake):
    """A clock that settled over items of no measured time (a clock that did not move)
    has no proportions: later items are counted, their steps get no seconds."""
    clock = StageClock(worker=0)
    clock.settled = True  # (as _judge leaves it with no busy seconds measured)
    t = fake.now
    for _ in range(3):
        clock.made(t, t, t, t)
    worker, done_at, items, busy, samples, times = clock.report(t, final=True)
    assert (items, busy) == (3, 0.0)
    assert named(times)["seeding"] == (0.0, 3, False)
