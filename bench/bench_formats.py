"""Benchmark reading shards where they are: indexed WebDataset tars against
``webdataset.WebDataset``, Parquet against ``pyarrow``'s ``iter_batches``, in one run.

Run from the repository root::

    python bench/bench_formats.py            # about 3 minutes on 2 cores
    python bench/bench_formats.py --quick    # about 1 minute
    python bench/bench_formats.py --json bench/results/formats.json

It writes, in a temporary folder, WebDataset tars (ImageNet-like samples: ``jpg``
random bytes of 8-24 kB, ``cls``, ``json``) and Parquet files (FineWeb-like rows: ``id``,
``url``, ``text`` of 0.5-4 kB, ``score``; row groups of 1,000 rows), indexes them with
``index_folder`` (timed), and measures samples per second:

* ``read``: one process: ``SavableDataLoader(BatchDataset(ShardedFileDataset(...), 32),
  num_workers=0)`` (shuffled: shards, or row groups, in a random order, samples in a
  random order inside each; a restore key per sample; batches passed on as lists, no
  conversion), against the library reading the same files sequentially:
  ``webdataset.WebDataset(urls)`` (dicts of bytes, as ours) and
  ``ParquetFile.iter_batches`` + ``RecordBatch.to_pylist()`` (dicts of Python values, as
  ours; same columns);
* ``loader``: 2 worker processes, the same pipeline, against
  ``torch.utils.data.DataLoader(webdataset.WebDataset(urls).batched(32))`` and against a
  ``DataLoader`` over an ``IterableDataset`` that splits the Parquet files over workers
  and yields ``iter_batches(32)`` rows.

Ours runs twice in each: by default (Python's, NumPy's and torch's global RNGs re-seeded
from every sample's restore key, about 7 us a sample, so that random maps downstream
resume exactly), and with ``global_rngs=()`` (none re-seeded, each item checked for
draws from them: for pipelines that draw no global randomness, such as these readers).

Every contender reads every sample once per epoch; the repeats are interleaved (A B C,
C B A, A B C, ...) so that drift in machine load hits all alike; the figure is the median
over repeats, the ratio ours / theirs. Targets: tar >= 0.9, Parquet >= 0.5 (both
``read``; each verdict printed for both runs of ours). ``main(argv)`` returns the results
as a dict.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_formats.py` puts bench/ first, not the root
    sys.path.insert(0, str(_REPO))

import numpy as np
import torch

import savable_loader as sl
from savable_loader.sources import ShardedFileDataset, index_folder
from savable_loader.wrappers import BatchDataset

BATCH = 32
TARGETS = {"tar": 0.9, "parquet": 0.5}


def write_tars(folder: Path, shards: int, per_shard: int) -> int:
    import webdataset as wds

    rng = np.random.default_rng(0)
    folder.mkdir()
    j = 0
    for s in range(shards):
        with wds.TarWriter(str(folder / f"train-{s:04d}.tar")) as writer:
            for _ in range(per_shard):
                jpg = rng.integers(0, 256, int(rng.integers(8_000, 24_000)), dtype=np.uint8).tobytes()
                writer.write(
                    {
                        "__key__": f"{j:08d}",
                        "jpg": jpg,
                        "cls": str(j % 1000).encode(),
                        "json": json.dumps({"id": j, "w": 256, "h": 256}).encode(),
                    }
                )
                j += 1
    return j


def write_parquet(folder: Path, files: int, rows: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(1)
    words = np.array(
        [
            w.encode()
            for w in [
                "the",
                "of",
                "and",
                "to",
                "in",
                "a",
                "is",
                "that",
                "for",
                "it",
                "as",
                "was",
                "with",
                "be",
                "by",
                "on",
                "not",
                "he",
            ]
        ]
    )
    folder.mkdir()
    j = 0
    for f in range(files):
        ids = list(range(j, j + rows))
        texts = [b" ".join(rng.choice(words, int(rng.integers(100, 800)))).decode() for _ in ids]
        table = pa.table(
            {
                "id": ids,
                "url": [f"https://example.org/{k}" for k in ids],
                "text": texts,
                "score": rng.random(rows).tolist(),
            }
        )
        pq.write_table(table, folder / f"part-{f:04d}.parquet", row_group_size=1000)
        j += rows
    return j


# -- contenders -----------------------------------------------------------------------------


def _as_is(batch: Any) -> Any:
    return batch


def ours(folder: Path, workers: int, global_rngs: tuple[str, ...] | None = None) -> Callable[[], int]:
    """Samples of one epoch through ``SavableDataLoader`` with ``workers`` workers (0: one
    process), in batches of ``BATCH`` passed on as lists."""

    def run() -> int:
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=0)
        ds = BatchDataset(ShardedFileDataset(folder, wc), BATCH, collate_fn=list)
        loader = sl.SavableDataLoader(ds, batch_size=None, worker_config=wc, collate_fn=_as_is, global_rngs=global_rngs)
        return _count_batches(loader)

    return run


def wds_read(folder: Path) -> Callable[[], int]:
    import webdataset as wds

    urls = sorted(str(p) for p in folder.glob("*.tar"))
    return lambda: sum(1 for _ in wds.WebDataset(urls, shardshuffle=False))


def pyarrow_rows(paths: list[Path], batch: int = 1000) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    for path in paths:
        for record_batch in pq.ParquetFile(path).iter_batches(batch_size=batch, use_threads=False):
            yield from record_batch.to_pylist()


def pyarrow_read(folder: Path) -> Callable[[], int]:
    paths = sorted(folder.glob("*.parquet"))
    return lambda: sum(1 for _ in pyarrow_rows(paths))


def _count_batches(loader: Any) -> int:
    return sum(len(batch) for batch in loader)


def wds_loader(folder: Path, workers: int) -> Callable[[], int]:
    import webdataset as wds

    urls = sorted(str(p) for p in folder.glob("*.tar"))

    def run() -> int:
        ds = wds.WebDataset(urls, shardshuffle=False).batched(BATCH, collation_fn=list)
        return _count_batches(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers))

    return run


class _ParquetStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        info = torch.utils.data.get_worker_info()
        mine = self.paths[info.id :: info.num_workers] if info is not None else self.paths
        rows = pyarrow_rows(mine, BATCH)
        while batch := [row for _, row in zip(range(BATCH), rows)]:
            yield batch


def pyarrow_loader(folder: Path, workers: int) -> Callable[[], int]:
    paths = sorted(folder.glob("*.parquet"))
    return lambda: _count_batches(
        torch.utils.data.DataLoader(_ParquetStream(paths), batch_size=None, num_workers=workers)
    )


def interleaved(pairs: dict[str, Callable[[], int]], expected: int, repeats: int) -> dict[str, float]:
    """Median samples/s of each contender over ``repeats`` runs in alternating order."""
    names = list(pairs)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up: page cache, imports
        pairs[name]()
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            count = pairs[name]()
            times[name].append(time.perf_counter() - t0)
            if count != expected:
                raise SystemExit(f"{name}: read {count} samples, expected {expected}")
    return {n: expected / statistics.median(t) for n, t in times.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer repeats")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the loader runs (default 2)")
    args = parser.parse_args(argv)
    tar_shards, per_shard, pq_files, rows, repeats = (8, 250, 4, 3000, 3) if args.quick else (16, 500, 8, 5000, 5)
    results: dict[str, Any] = {"workers": args.workers, "batch": BATCH, "repeats": repeats}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n_tar = write_tars(root / "tar", tar_shards, per_shard)
        n_pq = write_parquet(root / "parquet", pq_files, rows)
        for fmt, folder, n in (("tar", root / "tar", n_tar), ("parquet", root / "parquet", n_pq)):
            t0 = time.perf_counter()
            index_folder(folder, progress=False)
            size = sum(p.stat().st_size for p in folder.iterdir())
            results[f"{fmt}_data"] = {
                "samples": n,
                "files": tar_shards if fmt == "tar" else pq_files,
                "bytes": size,
                "index_s": time.perf_counter() - t0,
            }
            print(
                f"{fmt}: {n} samples, {size / 1e6:.0f} MB, indexed in {time.perf_counter() - t0:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        tar, pq = root / "tar", root / "parquet"
        baselines = {
            ("tar", "read"): (wds_read(tar), "webdataset.WebDataset"),
            ("tar", "loader"): (wds_loader(tar, args.workers), "DataLoader(WebDataset)"),
            ("parquet", "read"): (pyarrow_read(pq), "pyarrow iter_batches"),
            ("parquet", "loader"): (pyarrow_loader(pq, args.workers), "DataLoader(iter_batches)"),
        }
        plan = []
        for (fmt, mode), (theirs, name) in baselines.items():
            folder, n = (tar, n_tar) if fmt == "tar" else (pq, n_pq)
            workers = 0 if mode == "read" else args.workers
            contenders = {"ours": ours(folder, workers), "lean": ours(folder, workers, ()), "theirs": theirs}
            plan.append((fmt, mode, contenders, n, name))
        rows_out = []
        for fmt, mode, contenders, n, name in plan:
            print(f"{fmt} {mode} ...", file=sys.stderr, flush=True)
            rates = interleaved(contenders, n, repeats)
            row = {
                "format": fmt,
                "mode": mode,
                "baseline": name,
                "ours": rates["ours"],
                "theirs": rates["theirs"],
                "ratio": rates["ours"] / rates["theirs"],
            }
            row["lean"] = rates["lean"]
            row["lean_ratio"] = rates["lean"] / rates["theirs"]
            rows_out.append(row)
        results["runs"] = rows_out
    print(
        f"{'format':<8} {'mode':<7} {'ours (default)':>15} {'ratio':>6} {'ours, global_rngs=()':>21} {'ratio':>6} "
        f"{'baseline':>12}  baseline"
    )
    for r in results["runs"]:
        target = TARGETS[r["format"]] if r["mode"] == "read" else None
        verdict = ""
        if target is not None:
            both = " / ".join("PASS" if r[k] >= target else "MISS" for k in ("ratio", "lean_ratio"))
            verdict = f"  (target >= {target}: {both})"
        print(
            f"{r['format']:<8} {r['mode']:<7} {r['ours']:>12,.0f} /s {r['ratio']:>6.2f} {r['lean']:>18,.0f} /s "
            f"{r['lean_ratio']:>6.2f} {r['theirs']:>9,.0f} /s  {r['baseline']}{verdict}"
        )
    save_json(args.json, results)
    return results


def save_json(path: str | None, results: dict[str, Any]) -> None:
    """Write ``results`` as JSON to ``path`` (nothing when it is None)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
