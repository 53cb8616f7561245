"""``python -m savable_loader report``: a stats log added up per rank (``summarize``), in
words (``render``, ``advice``), through the command line, and as a plot."""

from __future__ import annotations

import pytest

from savable_loader.cli.main import main
from savable_loader.stats import LoaderStats, QueueStats, StageStats, WorkerStats
from savable_loader.stats.report import TIMELINE_ROWS, advice, plot, render, summarize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0


def window(
    rank: int,
    end: float,
    seconds: float,
    steps: int,
    wait: float,
    stages: dict[str, float],
    busy: dict[int, float] | None = None,
    epoch: int = 0,
    queue: tuple[float, int, float] | None = (0.5, 2, 0.25),
) -> LoaderStats:
    """A window ending ``end`` seconds after T0; ``stages``: name -> seconds (8 items
    each); ``busy``: worker -> busy seconds; ``queue``: (mean, max, empty share)."""
    busy = {0: 0.5 * seconds, 1: 0.5 * seconds} if busy is None else busy
    total = sum(stages.values())
    ranked = sorted(stages.items(), key=lambda kv: -kv[1])
    return LoaderStats(
        rank=rank,
        epoch=epoch,
        time=T0 + end,
        step=steps,
        seconds=seconds,
        steps=steps,
        samples=4 * steps,
        wait_seconds=wait,
        wait_share=wait / seconds,
        steps_per_s=steps / seconds,
        samples_per_s=4 * steps / seconds,
        workers=[
            WorkerStats(
                worker=w,
                items=steps // len(busy),
                samples=4 * steps // len(busy),
                busy_seconds=b,
                busy_share=min(b / seconds, 1.0),
            )
            for w, b in busy.items()
        ],
        queue=None if queue is None else QueueStats(mean=queue[0], max=queue[1], empty_share=queue[2]),
        stages=[StageStats(name=n, seconds=s, items=8, share=s / total if total else 0.0) for n, s in ranked],
        slowest=ranked[0][0] if ranked else None,
    )


def two_ranks() -> list[LoaderStats]:
    """Rank 0: input-bound, MapDataset(augment) slowest over the run (though not in its
    second window); rank 1: compute-bound, the source slowest. Out of time order."""
    return [
        window(0, 30.0, 10.0, 100, 9.0, {"MapDataset(augment)": 16.0, "IterableSource(read)": 2.0},
               busy={0: 9.5, 1: 9.7}, queue=(0.1, 1, 0.9)),
        window(1, 10.0, 10.0, 200, 0.2, {"MapDataset(augment)": 1.0, "IterableSource(read)": 3.0}),
        window(0, 10.0, 10.0, 100, 8.0, {"MapDataset(augment)": 14.0, "IterableSource(read)": 2.0},
               busy={0: 9.0, 1: 9.1}, queue=(0.3, 2, 0.7)),
        window(0, 20.0, 10.0, 100, 7.0, {"MapDataset(augment)": 1.0, "IterableSource(read)": 3.0},
               busy={0: 8.5, 1: 8.7}, queue=(0.5, 2, 0.5), epoch=1),
        window(1, 20.0, 10.0, 200, 0.4, {"MapDataset(augment)": 1.0, "IterableSource(read)": 2.0}, epoch=1),
    ]  # fmt: skip


def test_summarize_adds_the_windows_up_per_rank():
    ranks = summarize(two_ranks())
    assert [r.rank for r in ranks] == [0, 1]
    zero, one = ranks
    assert [w.time for w in zero.windows] == [T0 + 10.0, T0 + 20.0, T0 + 30.0]  # in time order
    assert (zero.seconds, zero.steps, zero.samples) == (30.0, 300, 1200)
    assert zero.wait_seconds == pytest.approx(24.0)
    assert zero.wait_share == pytest.approx(0.8)
    assert one.wait_share == pytest.approx(0.6 / 20.0)
    assert zero.ranked_stages() == [("MapDataset(augment)", pytest.approx(31.0), 24), ("IterableSource(read)", 7.0, 24)]
    assert one.ranked_stages()[0][0] == "IterableSource(read)"
    assert zero.stage_seconds == pytest.approx(38.0)
    assert zero.busy_shares() == {0: pytest.approx(27.0 / 30.0), 1: pytest.approx(27.5 / 30.0)}
    assert (zero.calls, zero.depth_max) == (300, 2)
    assert zero.depth_sum / zero.calls == pytest.approx((0.1 + 0.3 + 0.5) / 3)
    assert zero.empty / zero.calls == pytest.approx((0.9 + 0.7 + 0.5) / 3)


def test_summarize_nothing():
    assert summarize([]) == []
    assert "no windows" in render([], "run.jsonl")


def test_render_names_the_verdict_the_slowest_stage_and_what_to_try():
    text = render(summarize(two_ranks()), "run.jsonl")
    rank0, rank1 = text.split("run.jsonl: rank 1")
    assert rank0.startswith("run.jsonl: rank 0, 3 windows, epochs 0-1, 300 steps over 30.0 s of iteration")
    assert "input wait    80% (input-bound): the loop waited 24.0 s in next(loader)" in rank0
    assert "throughput    10 steps/s, 40 samples/s" in rank0
    assert "busy          worker 0 90%, worker 1 92%" in rank0
    assert "ready items   mean 0.3, max 2; none ready at 70% of next() calls" in rank0
    assert "slowest stage: MapDataset(augment) (82% of the loading time)" in rank0
    assert "what to try: the workers are busy (91% on average) and the loop still waits" in rank0
    assert "make the slowest stage, MapDataset(augment), lighter" in rank0
    # the table: the slowest first, with its share and items
    table = [line.split() for line in rank0.splitlines() if line.startswith(("  MapDataset", "  Iter"))]
    assert table == [["MapDataset(augment)", "31.00", "82%", "24"], ["IterableSource(read)", "7.00", "18%", "24"]]
    # over the run: a row per window, each with its own slowest stage
    rows = rank0.split("over the run:")[1].split("what to try")[0].strip().splitlines()[1:]
    assert [row.split() for row in rows] == [
        ["10.0s", "100", "80%", "10", "MapDataset(augment)"],
        ["20.0s", "100", "70%", "10", "IterableSource(read)"],
        ["30.0s", "100", "90%", "10", "MapDataset(augment)"],
    ]
    assert ", 2 windows, epochs 0-1, 400 steps over 20.0 s" in rank1
    assert "input wait    3% (compute-bound)" in rank1
    assert "slowest stage: IterableSource(read) (71% of the loading time)" in rank1
    assert "what to try: the loader keeps ahead of the training loop" in rank1


def test_a_long_run_is_merged_into_a_short_timeline():
    windows = [window(0, 10.0 * (i + 1), 10.0, 10, 5.0, {"A": 1.0 if i < 30 else 0.1, "B": 0.5}) for i in range(40)]
    text = render(summarize(windows))
    rows = text.split("over the run:")[1].split("what to try")[0].strip().splitlines()[1:]
    assert len(rows) <= TIMELINE_ROWS
    assert sum(int(row.split()[1]) for row in rows) == 400  # every step in some row
    assert rows[0].split()[-1] == "A" and rows[-1].split()[-1] == "B"


def rank(wait: float, busy: dict[int, float], stages: dict[str, float] | None = None):
    stages = {"MapDataset(decode)": 5.0, "collate": 1.0} if stages is None else stages
    return summarize([window(0, 10.0, 10.0, 100, wait, stages, busy=busy)])[0]


def test_advice_when_the_loop_is_the_limit():
    text = advice(rank(0.5, {0: 10.0, 1: 10.0}))
    assert text.startswith("the loader keeps ahead of the training loop")


def test_advice_when_the_data_is_made_in_the_training_process():
    text = advice(rank(6.0, {-1: 9.9}))
    assert "num_workers=0" in text and "num_workers > 0" in text
    assert "the slowest stage, MapDataset(decode)," in text


def test_advice_when_the_workers_are_busy():
    text = advice(rank(6.0, {0: 9.0, 1: 8.0, 2: 10.0}))
    assert text.startswith("the workers are busy (90% on average) and the loop still waits")
    assert "(3 now)" in text and "MapDataset(decode)" in text


def test_advice_when_the_workers_are_idle_and_the_loop_waits():
    text = advice(rank(6.0, {0: 2.0, 1: 3.0}))
    assert text.startswith("the loop waits while the workers are busy only 25% of the time: the main process")
    assert "prefetch_factor" in text


def test_advice_without_stages_names_the_dataset():
    text = advice(rank(6.0, {-1: 9.0}, stages={}))
    assert "make the dataset lighter" in text


def write_log(path, windows) -> None:
    path.write_text("".join(w.to_json() + "\n" for w in windows))


def test_cli_report_prints_the_verdict(tmp_path, capsys):
    log0, log1 = tmp_path / "stats-0.jsonl", tmp_path / "stats-1.jsonl"
    windows = two_ranks()
    write_log(log0, [w for w in windows if w.rank == 0])
    write_log(log1, [w for w in windows if w.rank == 1])
    assert main(["report", str(log0), str(log1)]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    assert out.out.startswith(f"{log0}, {log1}: rank 0, 3 windows")
    assert "input wait    80% (input-bound)" in out.out
    assert "input wait    3% (compute-bound)" in out.out
    assert "slowest stage: MapDataset(augment)" in out.out


def test_cli_report_of_an_empty_log(tmp_path, capsys):
    log = tmp_path / "stats-0.jsonl"
    log.write_text("")
    assert main(["report", str(log)]) == 0
    assert "no windows" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["not json", '{"version": 7}'])
def test_cli_report_of_a_malformed_log_exits_2_naming_the_file_and_line(tmp_path, capsys, bad):
    log = tmp_path / "stats-0.jsonl"
    log.write_text(two_ranks()[0].to_json() + "\n" + bad + "\n" + two_ranks()[1].to_json() + "\n")
    assert main(["report", str(log)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("savable-loader report: error: ")
    assert f"{log} line 2" in out.err


def test_cli_report_of_a_missing_log_exits_2(tmp_path, capsys):
    missing = tmp_path / "nothing.jsonl"
    assert main(["report", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_cli_report_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    log, png = tmp_path / "stats-0.jsonl", tmp_path / "out.png"
    write_log(log, two_ranks())
    assert main(["report", str(log), "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_plot_with_many_stages_and_one_window(tmp_path):
    pytest.importorskip("matplotlib")
    stages = {f"Stage{i}": float(i + 1) for i in range(9)}  # more than PLOT_STAGES: the rest as one
    png = tmp_path / "many.png"
    plot(summarize([window(0, 1.0, 1.0, 5, 0.5, stages)]), png)
    assert png.read_bytes()[:8] == PNG_SIGNATURE
