"""``--plot``: save latency and restore time against position in the epoch and against
the number of workers (matplotlib, from the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot"]


def plot(results: dict[str, Any], path: Path) -> str:
    """Write the figure to ``path``; returns what was done (or why not)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib is not installed ({e}); pip install '.[bench]'"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    for wname, wres in results["workloads"].items():
        for d in wres["contenders"].values():
            series = d.get("save_series_ms")
            if series:
                ax.plot(range(1, len(series) + 1), series, ".", markersize=3, label=f"{wname}: {d['label']}")
    ax.set(yscale="log", xlabel="batches into the run", ylabel="save latency (ms)", title="save latency along a run")
    ax.legend(fontsize=5)
    sc = results.get("scaling")
    if sc:
        ax = axes[0][1]
        pos = sc["restore_ms_vs_position"]
        for name, values in pos.items():
            if name == "workload":
                continue
            ax.plot([10, 50, 90], [values[p]["median"] for p in ("10", "50", "90")], "o-", label=name)
        ax.set(
            xlabel="% of the epoch at the save",
            ylabel="restore to first batch (ms)",
            title=f"restore time against position ({pos['workload']})",
            ylim=(0, None),
        )
        ax.legend(fontsize=7)
        workers = [int(n) for n in sc["workers"]]
        ax = axes[1][0]
        for name in ("savable", "savable-pipe"):
            for q in ("p50", "p99"):
                ax.plot(
                    workers, [sc["workers"][str(n)][f"{name}_save_ms"][q] for n in workers], "o-", label=f"{name} {q}"
                )
        ax.set(xscale="log", xlabel="workers", ylabel="save latency (ms)", title="save latency against workers")
        ax.set_xticks(workers, [str(n) for n in workers])
        ax.legend(fontsize=7)
        ax = axes[1][1]
        for name in ("savable", "savable-pipe"):
            ax.plot(workers, [sc["workers"][str(n)][f"{name}_restore_ms"] for n in workers], "o-", label=name)
        ax.set(
            xscale="log",
            xlabel="workers",
            ylabel="restore to first batch (ms)",
            title="restore time against workers",
            ylim=(0, None),
        )
        ax.set_xticks(workers, [str(n) for n in workers])
        ax.legend(fontsize=7)
    fig.suptitle(f"savable_loader bench, {results['date']} ({results['mode']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
