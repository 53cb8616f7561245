"""Benchmark reading shards from a bucket: cold cache with prefetch against a pre-filled
cache, and the requests a restore issues.

Run from the repository root::

    python bench/bench_remote.py            # S3 (a moto server on 127.0.0.1) and HTTP
    python bench/bench_remote.py --quick
    python bench/bench_remote.py --json bench/results/remote.json

It writes WebDataset tars (the data of ``bench_formats.py``), indexes them, serves them
from a local moto S3 server (the ``test`` extra; reached through a proxy that counts the
requests) and from an HTTP server that honours ``Range`` (``tests/storage_servers.py``),
each in its own process (so they compete with the reader for the machine's cores, not
for its GIL), and measures samples per second of
``ShardedFileDataset`` iterated as one worker does (shuffled), in one process:

* ``prefetch, cold``: an empty cache folder at each run, ``prefetch=2``: every shard is
  downloaded during the epoch, the next two in the background while one is read;
* ``no prefetch, cold``: the same with ``prefetch=0`` (each shard downloaded when reached);
* ``pre-filled cache``: every shard already in the cache (no download);
* ``local folder``: the files read in place.

The figure is the median over interleaved repeats (after one warm-up run each); the target is ``prefetch, cold`` /
``pre-filled cache`` >= 0.8. Then a restore: a state saved in the middle of the epoch is
restored into a loader with a cold cache, and the GET requests per shard are counted:
consumed shards must get none. ``main(argv)`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import savable_loader as sl
from bench.bench_formats import interleaved, save_json, write_tars
from savable_loader.config import _ActiveWorker
from savable_loader.sources import ShardedFileDataset, index_folder
from savable_loader.storage import Storage
from tests.storage_servers import MotoServer, ServerProcess

TARGET = 0.8
WC = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)


def read_epoch(location: Any) -> int:
    ds = ShardedFileDataset(location, WC)
    with _ActiveWorker(0, 0):
        n = sum(1 for _ in ds)
    ds.close()
    return n


def restore_gets(storage_of: Callable[[Path], Storage], log: Any, root: Path, shards: list[str]) -> dict[str, Any]:
    """Save half-way through an unshuffled epoch, restore with a cold cache, count GETs."""
    # prefetch=0 for the run that saves: no download of it may still be in flight when counting starts;
    # and for the restored run: at the epoch's end prefetch would fetch the next epoch's first
    # shards (unshuffled: the consumed ones), which are not the restore's
    loader = sl.SavableDataLoader(
        ShardedFileDataset(storage_of(root / "restore-a", 0), WC, shuffle=False), batch_size=None, worker_config=WC
    )
    total = loader.dataset.total
    it = iter(loader)
    for _ in range(total // 2):
        next(it)
    state = loader.save_state_rank()
    del it, loader
    log.reset()
    fresh = sl.SavableDataLoader(
        ShardedFileDataset(storage_of(root / "restore-b", 0), WC, shuffle=False), batch_size=None, worker_config=WC
    )
    fresh.restore_state_rank(state)
    rest = sum(1 for _ in fresh)
    entries = log.log
    gets = {name: sum(1 for m, p, _, _ in entries if m == "GET" and p.endswith("/" + name)) for name in shards}
    consumed = shards[: len(shards) // 2]
    return {
        "samples_after_restore": rest,
        "gets_per_shard": gets,
        "gets_for_consumed_shards": sum(gets[s] for s in consumed),
        "requests": len(entries),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller data, fewer repeats")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--backends", default="s3,http", help="comma-separated: s3, http (default both)")
    args = parser.parse_args(argv)
    shards, per_shard, repeats = (8, 250, 3) if args.quick else (16, 500, 5)
    results: dict[str, Any] = {"repeats": repeats, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n = write_tars(root / "tar", shards, per_shard)
        index_folder(root / "tar", progress=False)
        files = {p.name: p.read_bytes() for p in (root / "tar").iterdir() if p.is_file()}
        names = sorted(name for name in files if name.endswith(".tar"))
        results["data"] = {"samples": n, "shards": shards, "bytes": sum(len(files[s]) for s in names)}
        print(f"{n} samples in {shards} tars, {results['data']['bytes'] / 1e6:.0f} MB", file=sys.stderr)
        for backend in args.backends.split(","):
            if backend == "s3":
                moto = MotoServer()
                moto.bucket("bench", files)
                server: Any = ServerProcess("proxy", moto.port)
                options = moto.options(server.port)

                def storage_of(cache: Path, prefetch: int = 2, options: dict[str, Any] = options) -> Storage:
                    return Storage("s3://bench", storage_options=options, cache_dir=cache, prefetch=prefetch)
            else:
                moto = None
                server = ServerProcess("file", root)
                url = f"{server.url}/tar"

                def storage_of(cache: Path, prefetch: int = 2, url: str = url) -> Storage:
                    return Storage(url, cache_dir=cache, prefetch=prefetch)

            try:
                filled = root / f"{backend}-filled"
                read_epoch(storage_of(filled))  # fills the cache

                def cold(prefetch: int, backend: str = backend, storage_of: Any = storage_of) -> Callable[[], int]:
                    def run() -> int:
                        cache = root / f"{backend}-cold"
                        shutil.rmtree(cache, ignore_errors=True)
                        return read_epoch(storage_of(cache, prefetch))

                    return run

                print(f"{backend} ...", file=sys.stderr, flush=True)
                rates = interleaved(
                    {
                        "prefetch, cold": cold(2),
                        "no prefetch, cold": cold(0),
                        "pre-filled cache": lambda s=storage_of, f=filled: read_epoch(s(f)),
                        "local folder": lambda: read_epoch(root / "tar"),
                    },
                    n,
                    repeats,
                )
                restore = restore_gets(storage_of, server.faults, root / backend, names)
            finally:
                server.stop()
                if moto is not None:
                    moto.stop()
            results["runs"].append(
                {
                    "backend": backend,
                    **{k: v for k, v in rates.items()},
                    "ratio": rates["prefetch, cold"] / rates["pre-filled cache"],
                    "restore": restore,
                }
            )
    print(
        f"{'backend':<8} {'prefetch, cold':>15} {'no prefetch':>12} {'pre-filled':>11} {'local':>9}  ratio  "
        f"restore GETs (consumed shards)"
    )
    for r in results["runs"]:
        verdict = "PASS" if r["ratio"] >= TARGET else "MISS"
        print(
            f"{r['backend']:<8} {r['prefetch, cold']:>11,.0f} /s {r['no prefetch, cold']:>9,.0f} /s "
            f"{r['pre-filled cache']:>8,.0f} /s {r['local folder']:>6,.0f} /s  {r['ratio']:.2f} "
            f"(target >= {TARGET}: {verdict})  {r['restore']['gets_for_consumed_shards']}"
        )
    save_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
