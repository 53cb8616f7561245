"""``LoaderStats``: its JSON line (round trip, what is refused and how), the summary line,
the progress-bar fields and the verdict thresholds."""

from __future__ import annotations

import json

import msgspec
import pytest

from savable_loader.errors import DataError
from savable_loader.stats import LoaderStats, QueueStats, StageStats, WorkerStats
from savable_loader.stats.record import INPUT_BOUND, PARTLY_INPUT_BOUND, STATS_VERSION, verdict


def sample_stats(**changes) -> LoaderStats:
    fields = dict(
        rank=1,
        epoch=2,
        time=1_700_000_000.5,
        step=150,
        seconds=6.0,
        steps=50,
        samples=1600,
        wait_seconds=4.8,
        wait_share=0.8,
        steps_per_s=50 / 6.0,
        samples_per_s=1600 / 6.0,
        workers=[
            WorkerStats(worker=0, items=25, samples=800, busy_seconds=5.94, busy_share=0.99),
            WorkerStats(worker=1, items=25, samples=800, busy_seconds=5.7, busy_share=0.95),
        ],
        queue=QueueStats(mean=0.04, max=1, empty_share=0.96, series=[(0.1, 0), (0.2, 1)]),
        stages=[
            StageStats(name="MapDataset(augment)", seconds=10.0, items=1600, share=0.8),
            StageStats(name="IterableSource(read)", seconds=2.5, items=1600, share=0.2),
        ],
        slowest="MapDataset(augment)",
    )
    fields.update(changes)
    return LoaderStats(**fields)


def test_json_round_trip_is_exact():
    stats = sample_stats()
    line = stats.to_json()
    assert "\n" not in line
    back = LoaderStats.from_json(line)
    assert back == stats
    assert LoaderStats.from_json(line.encode()) == stats
    assert back.queue is not None and back.queue.series == [(0.1, 0), (0.2, 1)]
    assert json.loads(line) == json.loads(json.dumps(stats.to_dict()))  # (to_dict keeps the series' tuples)
    assert stats.to_dict()["version"] == STATS_VERSION
    assert stats.to_dict()["workers"][1] == {
        "worker": 1,
        "items": 25,
        "samples": 800,
        "busy_seconds": 5.7,
        "busy_share": 0.95,
    }


def test_an_empty_window_round_trips():
    stats = LoaderStats()
    assert LoaderStats.from_json(stats.to_json()) == stats
    assert (stats.queue, stats.slowest, stats.workers, stats.stages) == (None, None, [], [])


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not a stats line"),
        ("[1, 2]", "a stats line is a JSON object, got list"),
        ('"text"', "a stats line is a JSON object, got str"),
        ('{"steps": 3}', "stats line version is None, expected 1"),
        ('{"version": 2, "steps": 3}', "stats line version is 2, expected 1"),
        ('{"version": "1"}', "stats line version is '1', expected 1"),
        ('{"version": 1, "steps": "many"}', r"malformed stats line: .*\$\.steps"),
        ('{"version": 1, "workers": [{"worker": 0}]}', r"malformed stats line: .*items"),
    ],
)
def test_what_is_not_a_stats_line_is_a_data_error(line, message):
    with pytest.raises(DataError, match=message):
        LoaderStats.from_json(line)


def test_structs_are_frozen():
    stats = sample_stats()
    with pytest.raises(AttributeError):
        stats.wait_share = 0.0  # type: ignore[misc]
    assert msgspec.structs.replace(stats, wait_share=0.0).wait_share == 0.0


def test_summary_line():
    assert sample_stats().summary() == (
        "epoch 2 | 50 steps in 6 s | input wait 80% (input-bound) | 8.33 steps/s, 266.7 samples/s | "
        "workers busy 99% 95% | ready 0.0 (max 1) | slowest MapDataset(augment) 80%"
    )


def test_summary_of_a_bare_window_leaves_out_what_it_does_not_know():
    stats = LoaderStats(epoch=0, seconds=0.5, steps=3, wait_seconds=0.02, wait_share=0.04, steps_per_s=6.0)
    assert stats.summary() == "epoch 0 | 3 steps in 0.5 s | input wait 4% (compute-bound) | 6 steps/s, 0 samples/s"


def test_postfix_fields():
    assert sample_stats().postfix() == {
        "wait": "80%",
        "steps/s": "8.33",
        "busy": "97%",
        "slowest": "MapDataset(augment)",
    }
    assert LoaderStats(wait_share=0.05, steps_per_s=120.0).postfix() == {"wait": "5%", "steps/s": "120"}


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        (0.0, "compute-bound"),
        (PARTLY_INPUT_BOUND - 1e-9, "compute-bound"),
        (PARTLY_INPUT_BOUND, "partly input-bound"),
        (INPUT_BOUND - 1e-9, "partly input-bound"),
        (INPUT_BOUND, "input-bound"),
        (1.0, "input-bound"),
    ],
)
def test_verdict_thresholds(share, expected):
    assert verdict(share) == expected
    assert LoaderStats(wait_share=share).verdict == expected
