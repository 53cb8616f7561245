"""``python -m savable_loader report RUN.jsonl``: a stats log in words, and as a plot.

:func:`summarize` adds a log's windows up per rank (:class:`RankSummary`): the run's
wait share, throughput, workers' busy shares, items ready at ``next()``, each stage's
time and share, and the windows in time order. :func:`render` writes it as text with a
verdict and what to try; :func:`plot` draws the wait share and the stages' shares over
the run (matplotlib, the ``plot`` extra).

Example::

    summaries = summarize(read_log("run/stats-0.jsonl"))
    print(render(summaries))
    plot(summaries, "run/stats.png")
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from savable_loader.errors import LoaderUsageError
from savable_loader.stats.record import LoaderStats, verdict

__all__ = ["RankSummary", "plot", "render", "summarize"]

#: Rows of the "over the run" table (consecutive windows are merged to fit).
TIMELINE_ROWS = 12
#: Stages drawn one by one in the plot; the others are drawn as one.
PLOT_STAGES = 6


@dataclass
class RankSummary:
    """One rank's windows added up (see :func:`summarize`)."""

    rank: int
    windows: list[LoaderStats] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0
    samples: int = 0
    wait_seconds: float = 0.0
    #: worker -> [items, busy seconds]
    workers: dict[int, list[float]] = field(default_factory=dict)
    #: stage -> [seconds, items]
    stages: dict[str, list[float]] = field(default_factory=dict)
    calls: int = 0
    depth_sum: float = 0.0
    depth_max: int = 0
    empty: float = 0.0

    @property
    def wait_share(self) -> float:
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0

    @property
    def stage_seconds(self) -> float:
        return sum(s[0] for s in self.stages.values())

    def ranked_stages(self) -> list[tuple[str, float, int]]:
        """``(name, seconds, items)``, the most time first."""
        return sorted(((n, s[0], int(s[1])) for n, s in self.stages.items()), key=lambda t: (-t[1], t[0]))

    def busy_shares(self) -> dict[int, float]:
        return {w: min(v[1] / self.seconds, 1.0) if self.seconds > 0 else 0.0 for w, v in sorted(self.workers.items())}


def summarize(windows: Iterable[LoaderStats]) -> list[RankSummary]:
    """The windows of a log added up per rank, ranks in order."""
    ranks: dict[int, RankSummary] = {}
    for w in windows:
        r = ranks.get(w.rank)
        if r is None:
            r = ranks[w.rank] = RankSummary(w.rank)
        r.windows.append(w)
        r.seconds += w.seconds
        r.steps += w.steps
        r.samples += w.samples
        r.wait_seconds += w.wait_seconds
        for ws in w.workers:
            slot = r.workers.setdefault(ws.worker, [0, 0.0])
            slot[0] += ws.items
            slot[1] += ws.busy_seconds
        for st in w.stages:
            slot = r.stages.setdefault(st.name, [0.0, 0])
            slot[0] += st.seconds
            slot[1] += st.items
        if w.queue is not None and w.steps:
            r.calls += w.steps
            r.depth_sum += w.queue.mean * w.steps
            r.depth_max = max(r.depth_max, w.queue.max)
            r.empty += w.queue.empty_share * w.steps
    for r in ranks.values():
        r.windows.sort(key=lambda w: w.time)
    return [ranks[k] for k in sorted(ranks)]


def _worker_name(worker: int) -> str:
    return "main process" if worker < 0 else f"worker {worker}"


def advice(r: RankSummary) -> str:
    """What to try, from the wait share, the workers' busy shares and the slowest stage."""
    share = r.wait_share
    stages = r.ranked_stages()
    slowest = stages[0][0] if stages else None
    busy = r.busy_shares()
    if share < 0.1:
        return (
            "the loader keeps ahead of the training loop: the step time is the model's, and more workers or a "
            "lighter pipeline would not shorten it"
        )
    what = f"the slowest stage, {slowest}," if slowest else "the dataset"
    if busy and all(w < 0 for w in busy):
        return (
            f"the data is made in the training process (num_workers=0) and the loop waits for it: use worker "
            f"processes (num_workers > 0), or make {what} lighter"
        )
    mean_busy = sum(busy.values()) / len(busy) if busy else 0.0
    if mean_busy >= 0.8:
        return (
            f"the workers are busy ({mean_busy:.0%} on average) and the loop still waits: add workers if the "
            f"machine has idle cores ({len(busy)} now), or make {what} lighter (cache or precompute its work, "
            "move it to the GPU)"
        )
    return (
        f"the loop waits while the workers are busy only {mean_busy:.0%} of the time: the main process is the "
        "limit (the collate function, pin_memory, a large batch crossing from the workers) or too few items "
        "are prefetched (prefetch_factor); a savable pipeline's source may also wait on storage"
    )


def _timeline(r: RankSummary) -> list[str]:
    windows = r.windows
    if not windows:
        return []
    per_row = -(-len(windows) // TIMELINE_ROWS)
    start = windows[0].time - windows[0].seconds
    rows = [f"  {'at':>8}  {'steps':>7}  {'wait':>5}  {'steps/s':>8}  slowest"]
    for i in range(0, len(windows), per_row):
        group = windows[i : i + per_row]
        seconds = sum(w.seconds for w in group)
        steps = sum(w.steps for w in group)
        waited = sum(w.wait_seconds for w in group)
        stages: dict[str, float] = {}
        for w in group:
            for st in w.stages:
                stages[st.name] = stages.get(st.name, 0.0) + st.seconds
        slowest = max(stages, key=lambda n: stages[n]) if stages else "-"
        at = group[-1].time - start
        rows.append(
            f"  {at:>7.1f}s  {steps:>7}  {waited / seconds if seconds else 0:>5.0%}  "
            f"{steps / seconds if seconds else 0:>8.3g}  {slowest}"
        )
    return rows


def render(summaries: list[RankSummary], source: str = "") -> str:
    """The text of ``python -m savable_loader report`` for ``summaries``."""
    if not summaries:
        return f"{source or 'the stats log'}: no windows (the run wrote no stats line yet)\n"
    out: list[str] = []
    for r in summaries:
        epochs = sorted({w.epoch for w in r.windows})
        span = f"epoch {epochs[0]}" if len(epochs) == 1 else f"epochs {epochs[0]}-{epochs[-1]}"
        head = f"{source}: " if source else ""
        out.append(
            f"{head}rank {r.rank}, {len(r.windows)} windows, {span}, {r.steps} steps over {r.seconds:.1f} s of "
            "iteration"
        )
        out.append("")
        out.append(
            f"input wait    {r.wait_share:.0%} ({verdict(r.wait_share)}): the loop waited {r.wait_seconds:.1f} s in "
            "next(loader)"
        )
        if r.seconds > 0:
            out.append(f"throughput    {r.steps / r.seconds:.3g} steps/s, {r.samples / r.seconds:.4g} samples/s")
        busy = r.busy_shares()
        if busy:
            out.append("busy          " + ", ".join(f"{_worker_name(w)} {share:.0%}" for w, share in busy.items()))
        if r.calls:
            out.append(
                f"ready items   mean {r.depth_sum / r.calls:.1f}, max {r.depth_max}; none ready at "
                f"{r.empty / r.calls:.0%} of next() calls"
            )
        stages = r.ranked_stages()
        total = r.stage_seconds
        if stages:
            out.append("")
            width = max(len("stage"), *(len(n) for n, _, _ in stages))
            out.append(f"  {'stage':<{width}}  {'seconds':>9}  {'share':>5}  {'items':>9}")
            for name, seconds, items in stages:
                share = seconds / total if total > 0 else 0.0
                out.append(f"  {name:<{width}}  {seconds:>9.2f}  {share:>5.0%}  {items:>9}")
            out.append("")
            out.append(
                f"slowest stage: {stages[0][0]} ({stages[0][1] / total:.0%} of the loading time)" if total else ""
            )
        out.append("")
        out.append("over the run:")
        out.extend(_timeline(r))
        out.append("")
        out.append("what to try: " + advice(r))
        out.append("")
    return "\n".join(out)


def plot(summaries: list[RankSummary], path: str | os.PathLike[str]) -> None:
    """A PNG at ``path``: the wait share over the run (a line per rank), and each stage's
    share of the loading time (rank 0's, or the first rank's). Needs matplotlib
    (``pip install 'savable-loader[plot]'``): ``LoaderUsageError`` saying so otherwise."""
    try:  # (a Figure of its own: the caller's pyplot backend and figures are left alone)
        from matplotlib.figure import Figure
    except ImportError:
        raise LoaderUsageError(
            "report --plot needs matplotlib: pip install 'savable-loader[plot]' (or pip install matplotlib)"
        ) from None
    fig = Figure(figsize=(9, 6))
    top, bottom = fig.subplots(2, 1, sharex=True)
    start = min((r.windows[0].time - r.windows[0].seconds for r in summaries if r.windows), default=0.0)
    for r in summaries:
        xs = [w.time - start for w in r.windows]
        top.plot(xs, [100 * w.wait_share for w in r.windows], label=f"rank {r.rank}")
    top.set_ylabel("input wait (% of wall time)")
    top.set_ylim(0, 100)
    top.set_title("where the step time goes")
    top.legend(loc="upper right")
    first = next((r for r in summaries if r.windows), None)
    if first is not None:
        names = [n for n, _, _ in first.ranked_stages()]
        shown, rest = names[:PLOT_STAGES], names[PLOT_STAGES:]
        xs = [w.time - start for w in first.windows]
        series: list[list[float]] = []
        for name in shown:
            series.append([_share(w, (name,)) for w in first.windows])
        labels = list(shown)
        if rest:
            series.append([_share(w, tuple(rest)) for w in first.windows])
            labels.append("other stages")
        if series:
            bottom.stackplot(xs, *series, labels=labels)
            bottom.legend(loc="upper right", fontsize="small")
        bottom.set_ylim(0, 100)
    bottom.set_ylabel(f"stage share of loading time (%, rank {first.rank if first else 0})")
    bottom.set_xlabel("seconds since the start of the log's first window")
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)


def _share(w: LoaderStats, names: tuple[str, ...]) -> float:
    total = sum(s.seconds for s in w.stages)
    if total <= 0:
        return 0.0
    return 100 * sum(s.seconds for s in w.stages if s.name in names) / total
