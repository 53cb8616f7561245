"""The stats log: its path (``{rank}``, what is not a path), appending lines, reading
them back (a line cut by a kill, a malformed line named by file and line), and a log
that cannot be written (one warning, then silence)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from savable_loader.errors import DataError, LoaderUsageError
from savable_loader.stats import LoaderStats, read_log
from savable_loader.stats.log import StatsLog, log_path


def window(step: int, rank: int = 0, wait_share: float = 0.5) -> LoaderStats:
    return LoaderStats(rank=rank, step=step, steps=10, seconds=1.0, wait_seconds=wait_share, wait_share=wait_share)


def test_log_path_puts_the_rank_in():
    assert log_path("run/stats-{rank}.jsonl", 3) == Path("run/stats-3.jsonl")
    assert log_path(Path("run") / "r{rank}" / "s-{rank}.jsonl", 12) == Path("run/r12/s-12.jsonl")
    assert log_path("run/stats.jsonl", 5) == Path("run/stats.jsonl")  # the ranks share one file


@pytest.mark.parametrize(
    ("path", "message"),
    [
        (123, r"stats_log must be a path .*123"),
        (b"bytes.jsonl", r"stats_log must be a path .*bytes"),
        ("", r"stats_log must be a path or None, got ''"),
    ],
)
def test_log_path_refuses_what_is_not_a_path(path, message):
    with pytest.raises(LoaderUsageError, match=message):
        log_path(path, 0)


def test_lines_are_appended_and_read_back_in_order(tmp_path):
    path = tmp_path / "deep" / "er" / "stats.jsonl"  # folders made as needed
    log = StatsLog(path)
    written = [window(1), window(2, rank=1), window(3)]
    for stats in written:
        log(stats)
    text = path.read_text()
    assert text.endswith("\n") and text.count("\n") == 3
    assert [LoaderStats.from_json(line) for line in text.splitlines()] == written
    assert list(read_log(path)) == written
    assert list(read_log(str(path))) == written
    StatsLog(path)(window(4))  # another writer (a restarted run, another rank) appends
    assert [s.step for s in read_log(path)] == [1, 2, 3, 4]


def test_a_last_line_cut_by_a_kill_is_left_out(tmp_path):
    path = tmp_path / "stats.jsonl"
    lines = [window(1).to_json(), window(2).to_json()]
    cut = window(3).to_json()[:25]
    path.write_text(lines[0] + "\n" + lines[1] + "\n" + cut)
    assert [s.step for s in read_log(path)] == [1, 2]
    path.write_text(lines[0] + "\n" + lines[1][:-1])  # cut before its last brace
    assert [s.step for s in read_log(path)] == [1]


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "stats.jsonl"
    path.write_text("\n" + window(1).to_json() + "\n\n  \n" + window(2).to_json() + "\n\n")
    assert [s.step for s in read_log(path)] == [1, 2]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert list(read_log(empty)) == []


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("{cut", "not a stats line"),
        ('{"version": 99}', "version is 99"),
        ('{"version": 1, "steps": "x"}', "malformed stats line"),
    ],
)
def test_a_malformed_line_names_the_file_and_the_line(tmp_path, bad, why):
    path = tmp_path / "stats.jsonl"
    path.write_text(window(1).to_json() + "\n\n" + bad + "\n" + window(2).to_json() + "\n")
    got = []
    with pytest.raises(DataError) as caught:
        for stats in read_log(path):
            got.append(stats.step)
    assert got == [1]  # the lines before it were read
    message = str(caught.value)
    assert message.startswith(f"{path} line 3: ")
    assert why in message


def test_a_malformed_last_line_with_its_newline_is_an_error(tmp_path):
    path = tmp_path / "stats.jsonl"
    path.write_text(window(1).to_json() + "\n{cut\n")  # a whole line: written so, not cut
    with pytest.raises(DataError, match=r"line 2: "):
        list(read_log(path))


def test_a_missing_log_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        list(read_log(tmp_path / "nothing.jsonl"))


def test_a_log_that_cannot_be_written_warns_once(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the log's folder would be")
    log = StatsLog(blocker / "stats.jsonl")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            log(window(step))
    assert [w.category for w in caught] == [RuntimeWarning]
    message = str(caught[0].message)
    assert str(blocker / "stats.jsonl") in message and "cannot be written" in message
    assert log.failed
    assert blocker.read_text() == "a file where the log's folder would be"


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_folder_warns_once(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        log = StatsLog(folder / "stats.jsonl")
        with pytest.warns(RuntimeWarning, match="cannot be written"):
            log(window(1))
        assert log.failed
    finally:
        folder.chmod(0o700)
