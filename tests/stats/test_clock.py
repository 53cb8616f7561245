"""``StageClock`` and the timed iterators, on a clock the test moves (``clock._now``):
each stage's own time (the inner stages' time left out, however they nest, exceptions
included), items and samples, ``close()``, iterators that go on after an exception,
nothing wrapped outside an active clock, stage names, the sampling of cheap items, and
the reports."""

from __future__ import annotations

import functools
import threading
import types
from typing import Any

import pytest

import savable_loader as sl
from savable_loader.pipeline.worker import walk
from savable_loader.stats import clock as clock_module
from savable_loader.stats.clock import FLUSH_SECONDS, StageClock, activate, active_clock, stage_name
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


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    t = FakeTime()
    monkeypatch.setattr(clock_module, "_now", t)
    return t


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
    """An iterator (not a generator) that raises for its 3rd item and goes on, as torch
    allows an IterableDataset's iterator to (the loader raises that batch's error, and
    the next ``next()`` gets the next batch)."""

    def __init__(self, n: int) -> None:
        self.i, self.n = 0, n
        self.closed = False
        self.label = "goes on"

    def __iter__(self):
        return self

    def __next__(self) -> int:
        i = self.i
        self.i += 1
        if i >= self.n:
            raise StopIteration
        if i == 2:
            raise ValueError("item 2")
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
        assert getattr(wrapped, "gi_code", None) is not Source.__iter__.__wrapped__.__code__  # timed
        assert list(wrapped) == [0, 1, 2]
    assert active_clock() is None
    assert stages(clock)["Source"][1] == 3


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


def test_reports_carry_the_stages_when_due_and_at_the_end(fake):
    ds = Source(5, fake, cost=0.01)
    clock = StageClock()  # (flushed now)
    clock.name_stages([ds])
    start = fake.now
    reports = []
    with activate(clock):
        it = iter(ds)
        for at in (0.5, 1.0, 1.2):  # x FLUSH_SECONDS after the start
            next(it)
            fake.now = start + at * FLUSH_SECONDS
            reports.append(clock.report(worker=1, busy=0.01, now=fake.now))
        fake.now = start + 1.3 * FLUSH_SECONDS
        final = clock.report(worker=1, busy=0.0, now=fake.now, final=True)
    first, second, third = reports
    assert first == (1, start + 0.5 * FLUSH_SECONDS, 0.01, 1, None)
    worker, done_at, busy, samples, times = second
    assert (worker, done_at, busy, samples) == (1, start + FLUSH_SECONDS, 0.01, 1)
    assert times is not None and [(n, i) for n, _, i, _ in times] == [("Source", 2)]
    assert times[0][1] == pytest.approx(0.02)
    assert third == (1, start + 1.2 * FLUSH_SECONDS, 0.01, 1, None)  # flushed less than FLUSH_SECONDS ago
    assert final[:4] == (1, None, 0.0, 0)
    assert final[4] is not None and [(n, i) for n, _, i, _ in final[4]] == [("Source", 1)]
    assert final[4][0][1] == pytest.approx(0.01)


def run_items(clock: StageClock, fake: FakeTime, dataset: sl.SavableDataset, n: int):
    """Make ``n`` items as the pipeline runtime does (a report after each, and a final
    one); whether each was timed, the samples reported, and the stage times reported
    (name -> [seconds, items], summed over the reports)."""
    timed_items, samples = [], 0
    totals: dict[str, list[float]] = {}

    def add(report) -> None:
        nonlocal samples
        samples += report[3]
        for name, seconds, items, _ in report[4] or ():
            slot = totals.setdefault(name, [0.0, 0])
            slot[0] += seconds
            slot[1] += items

    with activate(clock):
        it = iter(dataset)
        for _ in range(n):
            clock.begin_item()
            timed_items.append(clock.on)
            t0 = fake()
            next(it)
            made = fake()
            clock.end_item(seeding=0.0, pipeline=made - t0)
            add(clock.report(worker=0, busy=made - t0, now=fake()))
        add(clock.report(worker=0, busy=0.0, now=fake(), final=True))
    return timed_items, samples, totals


def test_every_item_is_timed_when_the_budget_allows(monkeypatch):
    fake = FakeTime(read_cost=1e-9)  # 2 pulls cost 4e-9 s, far less than 0.3 % of an item of 2 ms
    monkeypatch.setattr(clock_module, "_now", fake)
    ds = MapDataset(Source(40, fake, cost=1e-3), sleeper(fake, 1e-3))
    clock = StageClock()
    clock.name_stages(walk(ds))
    timed_items, samples, totals = run_items(clock, fake, ds, 40)
    assert all(timed_items)
    assert samples == 40
    assert totals["MapDataset(step)"] == [pytest.approx(40e-3, rel=1e-3), 40]
    assert totals["Source"] == [pytest.approx(40e-3, rel=1e-3), 40]


def test_cheap_items_are_timed_in_a_sample_and_scaled(monkeypatch):
    """When timing every item would cost more than TIMING_BUDGET of the pipeline's time,
    some items are not timed; items are counted exactly, and the stage times scaled to
    all items."""
    fake = FakeTime(read_cost=1e-7)
    monkeypatch.setattr(clock_module, "_now", fake)
    monkeypatch.setattr(clock_module, "TIMING_BUDGET", 1e-5)  # 4 reads: 0.04 s of items, 1 item in 10
    n = 60
    ds = MapDataset(Source(n, fake, cost=1e-3), sleeper(fake, 3e-3))
    clock = StageClock()
    clock.name_stages(walk(ds))
    timed_items, samples, totals = run_items(clock, fake, ds, n)
    assert 4 <= timed_items.count(True) <= 12
    assert not clock.settled
    assert samples == n
    assert totals["MapDataset(step)"] == [pytest.approx(n * 3e-3, rel=0.01), n]
    assert totals["Source"] == [pytest.approx(n * 1e-3, rel=0.01), n]
    assert totals["seeding"][1] == n


def test_a_clock_whose_wrappers_cost_too_much_settles_and_divides_the_time(monkeypatch):
    """Where even an untimed wrapper costs more than the budget, the clock settles after
    PROBE_ITEMS items: the stages' time and items are the pipeline's divided in the
    proportions measured until then."""
    fake = FakeTime(read_cost=1e-9)
    monkeypatch.setattr(clock_module, "_now", fake)
    monkeypatch.setattr(clock_module, "TIMING_BUDGET", 2e-7)
    n = 3 * clock_module.PROBE_ITEMS
    ds = MapDataset(Source(n, fake, cost=1e-3), sleeper(fake, 3e-3))
    clock = StageClock()
    clock.name_stages(walk(ds))
    _, samples, totals = run_items(clock, fake, ds, n)
    assert clock.settled
    assert samples == n
    assert totals["MapDataset(step)"][0] == pytest.approx(n * 3e-3, rel=0.02)
    assert totals["Source"][0] == pytest.approx(n * 1e-3, rel=0.02)
    assert totals["MapDataset(step)"][1] == totals["Source"][1] == n
