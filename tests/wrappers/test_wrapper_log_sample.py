"""LogSampleDataset: per-worker JSON-lines logs whose keys are the samples yielded; the
stream is unchanged and resumes."""

from __future__ import annotations

import json
import os

import pytest

from savable_loader.errors import LoaderUsageError
from savable_loader.wrappers import BatchDataset, LogSampleDataset
from tests.common import RangeSource, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    check_restore_samples,
    make_loader,
    make_wc,
    worker_values,
)

pytestmark = pytest.mark.timeout(120)

N = 11


def read_log(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_logs_name_the_samples_yielded(num_workers, tmp_path):
    wc = make_wc(num_workers)
    workers = max(num_workers, 1)
    ds = LogSampleDataset(BatchDataset(RangeSource(N, wc), 2), tmp_path / "logs")
    epochs = epochs_of(make_loader(ds), 2)
    files = sorted(os.listdir(tmp_path / "logs"))
    assert files == [f"rank0-worker{w}.jsonl" for w in range(workers)]
    yielded = [[[int(v) for v in batch[:, 0]] for batch in e] for e in epochs]
    logged_keys = []
    for w in range(workers):
        lines = read_log(ds.log_path(w))
        assert {(x["rank"], x["worker"]) for x in lines} == {(0, w)}
        for epoch in range(2):
            mine = [x for x in lines if x["epoch"] == epoch]
            assert [x["index"] for x in mine] == list(range(len(mine)))
            values = worker_values(N, w, workers)
            assert [x["key"] for x in mine] == [values[i : i + 2] for i in range(0, len(values), 2)]
            logged_keys.append(sorted(map(tuple, (x["key"] for x in mine))))
    # every batch yielded is logged (the key of a batch is the list of its sample ids)
    for epoch in range(2):
        want = sorted(tuple(b) for b in yielded[epoch])
        got = sorted(k for keys in logged_keys[epoch::2] for k in keys) if workers == 2 else logged_keys[epoch]
        assert got == want


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_and_index_goes_on(num_workers, tmp_path):
    wc = make_wc(num_workers)
    factory = lambda: make_loader(LogSampleDataset(RangeSource(N, wc), tmp_path))
    steps = None if num_workers == 0 else [0, 4, N, 2 * N - 1]
    assert check_resume_everywhere(factory, 2, steps=steps) >= 4
    # the last line for each (epoch, index) names the sample at that index
    for w in range(max(num_workers, 1)):
        last = {}
        for x in read_log(os.path.join(tmp_path, f"rank0-worker{w}.jsonl")):
            last[(x["epoch"], x["index"])] = x["key"]
        values = worker_values(N, w, max(num_workers, 1))
        assert last == {(e, i): v for e in range(2) for i, v in enumerate(values)}


def test_restore_sample_and_arguments(tmp_path):
    wc = make_wc(0)
    assert check_restore_samples(lambda: LogSampleDataset(RangeSource(N, wc), tmp_path)) == 8
    with pytest.raises(LoaderUsageError, match="LogSampleDataset folder must be a path, got 3"):
        LogSampleDataset(RangeSource(N, wc), 3)
    ds = LogSampleDataset(RangeSource(N, wc), tmp_path)
    assert ds.config() == {}
    assert ds.log_path(1) == os.path.join(str(tmp_path), "rank0-worker1.jsonl")
