"""Where the drop-in path's per-sample time goes: each step on its own, per sample.

Run from the repository root::

    python -m bench.bench_costs            # a few seconds
    python -m bench.bench_costs --json bench/results/costs.json

Each figure is the median (min-max) over ``--repeats`` interleaved rounds of many calls,
in this process with one torch thread, in microseconds per sample (per-batch steps are
divided by the batch size, 64):

* **re-seed**: ``seed_global`` (Python ``random``, NumPy's and torch's global RNGs) and
  each of its three parts; **seed derivation**: ``counter_seed`` per sample and
  ``derive_seed`` per batch (the collate seed);
* **batch keys**: the main process making the keys of a rank's epoch
  (``IndexPlan.batches``: the Feistel order evaluated a chunk at a time, the shares, the
  ``BatchKey`` tuples); **key round trip**: pickling a key to a worker and back, as
  torch's index queue does;
* **build overhead**: ``IndexedDataset.build`` on a dataset that does nothing, minus the
  same loop without the library (re-seeds, seed derivation and bookkeeping together),
  per sample (the default) and with ``reseed="batch"``;
* **in-process RNG preservation**: ``preserve_global_rng`` around a batch, which only
  ``num_workers=0`` pays;
* **build overhead with** ``global_rngs=("torch",)``: only torch's RNG re-seeded per
  sample, the two others guarded once per batch (the guard's check alone on its row);
* **pipeline sources**: ``SavableDataset.mark_sample`` of a ``[shard, row, lap]`` key
  (the key's seed, then the re-seed of the three global RNGs; on top of the runtime's
  per-item re-seed), and the key's seed alone.

``main(argv)`` returns the results as a dict (``python -m bench`` includes them).
"""

from __future__ import annotations

import argparse
import pickle
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_costs.py` puts bench/ first
    sys.path.insert(0, str(_REPO))

import torch

import savable_loader as sl
from bench import measure as M
from savable_loader.index.source import IndexedDataset, IndexPlan
from savable_loader.rng import seeding as rng
from savable_loader.rng.formulas import key_prefix, key_seed_of
from savable_loader.rng.global_rngs import GlobalRngs, global_rngs_setting

BATCH = 64


class Nothing:
    """A dataset whose samples cost nothing: the loader's own cost shows alone."""

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, i: int) -> int:
        return i


def _identity(samples: Any) -> Any:
    return samples


class _Source(sl.SavableDataset):
    """A pipeline source, for its ``mark_sample``."""

    def config(self) -> dict[str, Any]:
        return {}


def steps() -> dict[str, tuple[Callable[[int], Any], int, int]]:
    """name -> (call(i), calls per round, samples per call)."""
    plan = IndexPlan(10**6, seed=0, shuffle=True, rank=1, world_size=2, batch_size=BATCH, drop_last=False)
    keys = list(plan.batches(0, 0))[:200]
    ds = IndexedDataset(Nothing(), seed=0, collate_fn=_identity, batched=True)
    per_batch = IndexedDataset(Nothing(), seed=0, collate_fn=_identity, batched=True, reseed="batch")
    torch_only = IndexedDataset(
        Nothing(), seed=0, collate_fn=_identity, batched=True, global_rngs=global_rngs_setting(("torch",))
    )
    guard = GlobalRngs(global_rngs_setting(("torch",)))
    nothing = Nothing()
    base = rng.derive_seed(0, "sample", 0)
    source = _Source(sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0))
    prefix = key_prefix(0, 0, (), "_Source")

    def guard_batch(i: int) -> None:
        guard.begin(0, 0)
        guard.check("")

    def plain_loop(i: int) -> Any:
        key = keys[i % len(keys)]
        return _identity([nothing[j] for j in key.indices])

    def make_keys(i: int) -> None:
        for n, _ in enumerate(plan.batches(i % 7, 0)):
            if n == 199:
                break

    def preserve(i: int) -> None:
        with rng.preserve_global_rng():
            pass

    return {
        "re-seed (seed_global)": (lambda i: rng.seed_global(rng.counter_seed(base, i)), 20_000, 1),
        "  python random": (lambda i: rng._PY_SEED(rng._PY_RANDOM, i * 7919), 20_000, 1),
        "  numpy": (lambda i: rng._NP_SEED(((i * 0x9E3779B97F4A7C15) & (2**64 - 1)) >> 32), 20_000, 1),
        "  torch": (lambda i: rng._TORCH_SEED(i), 20_000, 1),
        "seed derivation (counter_seed)": (lambda i: rng.counter_seed(base, i), 50_000, 1),
        "collate seed (derive_seed per batch)": (lambda i: rng.derive_seed(0, "collate", 0, i), 20_000, BATCH),
        "batch keys in the main process": (make_keys, 20, 200 * BATCH),
        "key round trip (pickle to a worker)": (
            lambda i: pickle.loads(pickle.dumps(keys[i % len(keys)], pickle.HIGHEST_PROTOCOL)),
            5_000,
            BATCH,
        ),
        "build overhead (IndexedDataset.build - plain loop)": (lambda i: ds.build(keys[i % len(keys)]), 1_000, BATCH),
        "  the plain loop it is measured against": (plain_loop, 1_000, BATCH),
        'build overhead with reseed="batch" (- plain loop)': (
            lambda i: per_batch.build(keys[i % len(keys)]),
            5_000,
            BATCH,
        ),
        "in-process RNG preservation (per batch)": (preserve, 2_000, BATCH),
        'build overhead with global_rngs=("torch",) (- plain loop)': (
            lambda i: torch_only.build(keys[i % len(keys)]),
            2_000,
            BATCH,
        ),
        "  guard of the two left out (per batch)": (guard_batch, 5_000, BATCH),
        "pipeline mark_sample([shard, row, lap])": (lambda i: source.mark_sample([3, i, 0]), 20_000, 1),
        "  key seed alone (key_seed_of)": (lambda i: key_seed_of(prefix, b"[3,%d,0]" % i), 50_000, 1),
    }


def _round(call: Callable[[int], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for i in range(calls):
        call(i)
    return time.perf_counter() - t0


def run(repeats: int) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        table = steps()
        for call, calls, _ in table.values():  # warm-up
            _round(call, max(1, calls // 10))
        got = M.interleaved({name: (lambda r, c=c, n=n: _round(c, n)) for name, (c, n, _) in table.items()}, repeats)
    finally:
        torch.set_num_threads(threads)
    out: dict[str, Any] = {"repeats": repeats, "batch_size": BATCH, "us_per_sample": {}}
    for name, (_, calls, per_call) in table.items():
        out["us_per_sample"][name] = M.spread([s / (calls * per_call) * 1e6 for s in got[name]])
    plain = got["  the plain loop it is measured against"]
    plain_calls = table["  the plain loop it is measured against"][1]
    for name in (
        "build overhead (IndexedDataset.build - plain loop)",
        'build overhead with reseed="batch" (- plain loop)',
        'build overhead with global_rngs=("torch",) (- plain loop)',
    ):
        calls = table[name][1]
        out["us_per_sample"][name] = M.spread(
            [(b / calls - p / plain_calls) / BATCH * 1e6 for b, p in zip(got[name], plain)]
        )
    return out


def render(out: dict[str, Any]) -> str:
    rows = [["step", "µs per sample"]]
    for name, fig in out["us_per_sample"].items():
        rows.append([name.replace("  ", "· "), M.fmt_spread(fig)])
    return M.table(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="per-sample costs of the drop-in path, step by step")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved rounds (default 7)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    out = run(args.repeats)
    return M.finish(out, render(out), args.json)


if __name__ == "__main__":
    main()
