"""``StageClock``, on a clock the test moves (``clock._now``): each stage's own time (the
inner stages' time left out, however they nest), items and samples, stage names, the
sampling of cheap items, the settling of a clock whose wrappers cost too much, and what
travels with each item (``made()``, ``replayed()``, the reports)."""

from __future__ import annotations

import functools
from typing import Any

import pytest

import savable_loader as sl
from savable_loader.pipeline.worker import walk
from savable_loader.stats import clock as clock_module
from savable_loader.stats.clock import FLUSH_SECONDS, StageClock, stage_name
from savable_loader.stats.timed import activate
from savable_loader.wrappers import BatchDataset, MapDataset
from tests.stats.clock_helpers import WC, FakeTime, Source, Wrapper, sleeper, stages, timed_run, use_fake


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


def settled_run(monkeypatch, inline: bool, replays: int = 0, collate_cost: float = 2e-3):
    """Make 200 items of known costs as the pipeline runtime does: ``replays`` of them
    replayed first, a snapshot (5 ms) every 40th, the clock settling after the first
    probe window. ``inline``: once settled, the runtime's own sums of the items (by their
    index), their busy seconds (ended before the collate function where
    ``collate_estimated``) and the snapshots, added to the clock before each report
    (``WorkerRuntime.run``), instead of ``made()`` and ``add()``. The reports, and the
    true seconds of each step."""
    fake = use_fake(monkeypatch, FakeTime(read_cost=1e-9))
    monkeypatch.setattr(clock_module, "TIMING_BUDGET", 2e-7)  # (settles: see above)
    n = 200
    ds = MapDataset(Source(n, fake, cost=1e-3), sleeper(fake, 3e-3))
    clock = StageClock(worker=4)
    clock.name_stages(walk(ds))
    reports: list[Any] = []
    truth = {"seeding": 0.0, "collate": 0.0, "snapshot": 0.0, "busy": 0.0}
    settled, booked, busy, snapshot_sum, snapshots = False, 0, 0.0, 0.0, 0

    def flush(index: int) -> None:
        clock.sent, clock.busy = clock.sent + index - booked, clock.busy + busy
        if snapshots:
            clock.add("snapshot", snapshot_sum, snapshots)

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
                if settled:
                    snapshot_sum, snapshots = snapshot_sum + snapped - mark, snapshots + 1
                else:
                    clock.add("snapshot", snapped - mark)
                truth["snapshot"] += snapped - mark
                collating = mark = snapped
            if not replay:
                fake.sleep(collate_cost)
                mark = fake()
                truth["collate"] += mark - collating
            truth["busy"] += mark - begun
            if settled:  # (summed in locals, added before each report; never a replay)
                busy += (collating if clock.collate_estimated else mark) - begun
                if mark >= clock.due:
                    flush(k + 1)
                    booked, busy, snapshot_sum, snapshots = k + 1, 0.0, 0.0, 0
                    reports.append(clock.report(mark))
                continue
            if replay:
                clock.replayed(begun, pulled, made)
            else:
                report = clock.made(begun, pulled, made, mark, mark - collating)
                if type(report) is tuple:
                    reports.append(report)
            if inline and clock.settled:
                settled, booked = True, k + 1
        if settled:
            flush(n)
        reports.append(clock.report(fake(), final=True))
    assert clock.settled
    assert clock.replays == 0  # (a clock settles on sent items, after a replay)
    assert clock.collate_estimated is (collate_cost / (0.5e-3 + 4e-3 + collate_cost) <= 0.5)
    return reports, truth


@pytest.mark.parametrize("collate_cost", [2e-3, 8e-3])  # (a share of an item's time of 0.31, 0.64)
@pytest.mark.parametrize("inline", [False, True])
def test_a_settled_clock_divides_the_items_time_among_seeding_stages_and_collate(monkeypatch, inline, collate_cost):
    """Once settled, each item's busy seconds (the snapshots, still timed, left out) are
    divided among the re-seeding, the stages and the collate function in the proportions
    measured until then; the items, the busy seconds and the snapshots stay exact (the
    collate function's seconds, where its share is small, at that share: exact here, where
    it costs the same for every item), and the runtime's own additions to the counters
    report what ``made()`` reports."""
    reports, truth = settled_run(monkeypatch, inline, collate_cost=collate_cost)
    assert len(reports) > 3  # (reports due every FLUSH_SECONDS of the 1.3 s run, and the final one)
    items, busy, samples, totals = summed(reports)
    assert (items, samples) == (200, 200)
    assert busy == pytest.approx(truth["busy"], rel=1e-6)  # (collate at its share: the reads aside)
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
    """A restored worker's replay (the clock settles after it, on sent items): the
    replayed items' seconds are busy time and divided among the steps, the items are not
    sent."""
    reports, truth = settled_run(monkeypatch, inline, replays=60)
    items, busy, samples, totals = summed(reports)
    assert items == 140  # (sent: the 200 made, less the 60 replayed)
    assert samples == 200  # (what the source read, the replay included)
    assert busy == pytest.approx(truth["busy"], rel=1e-6)  # (collate at its share: the reads aside)
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
