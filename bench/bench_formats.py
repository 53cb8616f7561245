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

* ``read``: one process, no loader: ``ShardedFileDataset`` iterated as one worker does
  (shuffled: shards, or row groups, in a random order, samples in a random order inside
  each; a restore key and the global RNGs re-seeded per sample), against the library
  reading the same files sequentially: ``webdataset.WebDataset(urls)`` (dicts of bytes,
  as ours) and ``ParquetFile.iter_batches`` + ``RecordBatch.to_pylist()`` (dicts of
  Python values, as ours; same columns);
* ``loader``: 2 worker processes, batches of 32 samples as lists (no collation):
  ``SavableDataLoader(BatchDataset(ShardedFileDataset(...)))`` against
  ``torch.utils.data.DataLoader(webdataset.WebDataset(urls).batched(32))`` and against a
  ``DataLoader`` over an ``IterableDataset`` that splits the Parquet files over workers
  and yields ``iter_batches(32)`` rows.

``read`` also runs ours once more with ``mark_sample`` reduced to recording the key
(``reader only``): what the readers cost without the per-sample re-seeding of Python's,
NumPy's and torch's global RNGs (about 10 us a sample) that every savable_loader source
does so that ``restore_sample`` rebuilds a sample's random draws.

Every contender reads every sample once per epoch; the repeats are interleaved (A B C,
C B A, A B C, ...) so that drift in machine load hits all alike; the figure is the median
over repeats, the ratio ours / theirs. Targets: tar >= 0.9, Parquet >= 0.5 (both
``read``). ``main(argv)`` returns the results as a dict.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

import savable_loader as sl  # noqa: E402
from savable_loader.config import _ActiveWorker  # noqa: E402
from savable_loader.sources import ShardedFileDataset, index_folder  # noqa: E402
from savable_loader.wrappers import BatchDataset  # noqa: E402

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
    words = np.array([w.encode() for w in "the of and to in a is that for it as was with be by on not he".split()])
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


def ours_read(folder: Path, reseed: bool = True) -> Callable[[], int]:
    def run() -> int:
        ds = ShardedFileDataset(folder, sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0))
        if not reseed:  # diagnostic only: the reader's own cost
            ds.mark_sample = lambda key: setattr(ds, "sample_key", key)  # type: ignore[method-assign]
        with _ActiveWorker(0, 0):
            return sum(1 for _ in ds)

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


def ours_loader(folder: Path, workers: int) -> Callable[[], int]:
    def run() -> int:
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=0)
        ds = BatchDataset(ShardedFileDataset(folder, wc), BATCH, collate_fn=list)
        return _count_batches(sl.SavableDataLoader(ds, batch_size=None, worker_config=wc))

    return run


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
        plan = [
            (
                "tar",
                "read",
                {"ours": ours_read(tar), "theirs": wds_read(tar), "reader only": ours_read(tar, False)},
                n_tar,
                "webdataset.WebDataset",
            ),
            (
                "tar",
                "loader",
                {"ours": ours_loader(tar, args.workers), "theirs": wds_loader(tar, args.workers)},
                n_tar,
                "DataLoader(WebDataset)",
            ),
            (
                "parquet",
                "read",
                {"ours": ours_read(pq), "theirs": pyarrow_read(pq), "reader only": ours_read(pq, False)},
                n_pq,
                "pyarrow iter_batches",
            ),
            (
                "parquet",
                "loader",
                {"ours": ours_loader(pq, args.workers), "theirs": pyarrow_loader(pq, args.workers)},
                n_pq,
                "DataLoader(iter_batches)",
            ),
        ]
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
            if "reader only" in rates:
                row["reader_only"] = rates["reader only"]
                row["reader_only_ratio"] = rates["reader only"] / rates["theirs"]
            rows_out.append(row)
        results["runs"] = rows_out
    print(
        f"{'format':<8} {'mode':<7} {'ShardedFileDataset':>19} {'baseline':>12}  {'ratio':>6}  {'reader only':>18}  "
        f"baseline"
    )
    for r in results["runs"]:
        target = TARGETS[r["format"]] if r["mode"] == "read" else None
        verdict = "" if target is None else f"  (target >= {target}: {'PASS' if r['ratio'] >= target else 'MISS'})"
        only = f"{r['reader_only']:>9,.0f} /s {r['reader_only_ratio']:>4.2f}" if "reader_only" in r else " " * 18
        print(
            f"{r['format']:<8} {r['mode']:<7} {r['ours']:>13,.0f} /s {r['theirs']:>10,.0f} /s  {r['ratio']:>6.2f}  "
            f"{only}  {r['baseline']}{verdict}"
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
