"""What loading in the caller's process (``num_workers=0``) costs per item.

Run from the repository root::

    python -m bench.bench_inprocess              # about half a minute
    python -m bench.bench_inprocess --quick

A savable pipeline whose items cost nothing (a counter) is iterated by
``SavableDataLoader(..., batch_size=None, num_workers=0)`` (through
``BatchDataset(..., batch_size=B)`` where ``B`` is given) by default and with
``global_rngs=()``, beside a plain ``torch.utils.data.DataLoader`` over an
IterableDataset yielding the same ints, in the same run (interleaved repeats), for each
``B`` of ``--batch-sizes`` (``none``: ``batch_size=None``, one item a ``next()``; 32: 32
items a ``next()``, collated as a list). The figures are µs per item and the ratio to
torch's. What the loader adds: once per ``next()``, the caller's three random streams
set aside and put back (``rng.states.CallerStreams``: torch's and Python's states
copied through their public APIs, NumPy's bit generator swapped); per item, the
runtime's bookkeeping (position, snapshot policy), the re-seeding, and with
``global_rngs=()`` the three generators put in their fixed state and checked after the
item (``rng.states.FixedStates``). Issue 30's targets compare these with the figures of
the release that copied the generators' memory (docs/performance.md).

``main(argv)`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_inprocess.py` puts bench/ first
    sys.path.insert(0, str(_REPO))

import torch

import savable_loader as sl
from bench import measure as M
from savable_loader.wrappers import BatchDataset


class Count(sl.SavableDataset):
    """Items 1..n, nothing else: the loader's own cost shows alone."""

    _savable_fields = ("pos",)

    def __init__(self, n: int, wc: sl.WorkerConfig) -> None:
        super().__init__(wc)
        self.n = n
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = 0

    def __iter__(self) -> Any:
        while self.pos < self.n:
            self.pos += 1
            yield self.pos

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


class Plain(torch.utils.data.IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(range(self.n))


def _as_is(x: Any) -> Any:
    return x


def ours(n: int, global_rngs: tuple[str, ...] | None, batch_size: int | None) -> float:
    """µs per item of one epoch of the savable loader (``batch_size`` items a ``next()``)."""
    wc = sl.WorkerConfig(num_workers=0, seed=0)
    pipeline: sl.SavableDataset = Count(n, wc)
    if batch_size is not None:  # a pipeline batches inside (its items are then batches)
        pipeline = BatchDataset(pipeline, batch_size=batch_size, collate_fn=_as_is)
    loader = sl.SavableDataLoader(
        pipeline, batch_size=None, worker_config=wc, collate_fn=_as_is, global_rngs=global_rngs
    )
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return (time.perf_counter() - t0) / n * 1e6


def plain(n: int, batch_size: int | None) -> float:
    """µs per item of one epoch of torch's DataLoader."""
    loader = torch.utils.data.DataLoader(Plain(n), batch_size=batch_size, collate_fn=_as_is)
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return (time.perf_counter() - t0) / n * 1e6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer items and repeats")
    parser.add_argument(
        "--batch-sizes",
        default="none,32",
        help="comma-separated batch sizes ('none': batch_size=None, one item a next()); default none,32",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, repeats = (2_048, 3) if args.quick else (20_480, 7)
    sizes = [None if b.strip().lower() == "none" else int(b) for b in args.batch_sizes.split(",")]
    out: dict[str, Any] = {"items": n, "repeats": repeats, "us_per_item": {}, "ratio_to_torch": {}}
    print(f"µs per item in the caller's process ({n} items, {repeats} interleaved repeats; median (min-max))")
    for size in sizes:
        label = f"batch_size={size}"
        runs = M.interleaved(
            {
                f"torch DataLoader [baseline], {label}": lambda r, b=size: plain(n, b),
                f"SavableDataLoader (pipeline, default), {label}": lambda r, b=size: ours(n, None, b),
                f"SavableDataLoader (pipeline, global_rngs=()), {label}": lambda r, b=size: ours(n, (), b),
            },
            repeats,
        )
        base = runs[f"torch DataLoader [baseline], {label}"]
        for name, values in runs.items():
            ratios = [v / b for v, b in zip(values, base)]
            out["us_per_item"][name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            out["ratio_to_torch"][name] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
            print(
                f"  {name:<62} {statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"
                f"   x torch {statistics.median(ratios):5.2f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
