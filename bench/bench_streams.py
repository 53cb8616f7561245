"""Benchmark RedisStreamSource: entries per second against a plain redis client, and a
save's latency while the workers wait on an empty stream.

Run from the repository root::

    python bench/bench_streams.py            # about a minute on 2 cores
    python bench/bench_streams.py --quick    # about 15 s
    python bench/bench_streams.py --json bench/results/streams.json

It starts a ``redis-server`` on a free loopback port (``tests/redis_server.py``; Debian's
package, in memory only) and fills one stream with ``--entries`` entries of two fields
(``i``, and ``data``: ``--bytes`` random bytes). Then, in interleaved repeats (after one
warm-up run each):

* ``plain redis``: one process, one client, ``XRANGE`` in pages of 256 entries from the
  first to the last, each entry made into the same dict the source yields (``str`` field
  names, ``bytes`` values, ``"__id__"``);
* ``RedisStreamSource, 2 workers``: ``BatchDataset(RedisStreamSource(follow=False), 64)``
  through a ``SavableDataLoader`` with 2 worker processes (``collate_fn`` passes the
  batches on as they are), one epoch: every entry once, timed from the first batch on
  (the workers' process start and first page are left out: the plain client, already
  running in this process, pays neither; a stream is read for hours). The server
  filters each worker's entries (a Lua scan), and each worker re-seeds the global RNGs
  from each entry's id (``mark_sample``, the RNG rule of ``SavableDataset``), which the
  plain client does not;
* ``RedisStreamSource, 2 workers, global_rngs=()``: the same loader re-seeding no global
  RNG (each item checked for draws instead): for pipelines that draw no global
  randomness.

The figure is entries per second, the paired ratio source / plain per repeat (median,
min-max; target >= 0.8, judged for both runs of the source). Then the save: a ``follow=True`` loader with 2 workers over an
empty stream, iterated by a thread that waits for the first entry, while the main thread
calls ``save_state_rank()`` ``--saves`` times: p50, p99 and max in ms. ``main(argv)``
returns the results as a dict.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_streams.py` puts bench/ first, not the root
    sys.path.insert(0, str(_REPO))

import savable_loader as sl
from bench import measure as M
from savable_loader.sources import RedisStreamSource
from savable_loader.wrappers import BatchDataset
from tests.redis_server import RedisServer

WORKERS = 2
BATCH = 64
PAGE = 256
TARGET = 0.8
SAVE_TARGET_MS = 5.0


def fill(server: RedisServer, stream: str, entries: int, size: int) -> None:
    client = server.client()
    client.delete(stream)
    payload = os.urandom(size)
    for start in range(0, entries, 1000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(start + 1000, entries)):
            pipe.xadd(stream, {"i": str(i).encode(), "data": payload})
        pipe.execute()


def plain(server: RedisServer, stream: str, entries: int) -> float:
    """Entries per second of one client reading the stream page by page, in this process."""
    client = server.client()
    t0 = time.perf_counter()
    count, cursor = 0, "-"
    while True:
        page = client.xrange(stream, min=cursor, max="+", count=PAGE + (cursor != "-"))
        if cursor != "-":
            page = page[1:]
        if not page:
            break
        for entry_id, fields in page:
            sample = {k.decode(): v for k, v in fields.items()}
            sample["__id__"] = entry_id.decode()
            count += 1
        cursor = page[-1][0].decode()
    wall = time.perf_counter() - t0
    if count != entries:
        raise RuntimeError(f"plain read {count} entries, expected {entries}")
    return entries / wall


def _collate(batch: list[Any]) -> list[Any]:
    return batch


def through_source(server: RedisServer, stream: str, entries: int, global_rngs: tuple[str, ...] | None = None) -> float:
    """Entries per second of one epoch through a 2-worker SavableDataLoader (built with
    ``global_rngs``), from its first batch on: the workers' start-up (a process start and
    the first page, which the plain client in this process does not pay) is left out, and
    so are the first batch's entries."""
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=WORKERS, seed=0)
    ds = BatchDataset(RedisStreamSource(server.url, stream, wc, follow=False, batch=PAGE), BATCH, collate_fn=_collate)
    loader = sl.SavableDataLoader(ds, batch_size=None, worker_config=wc, collate_fn=_collate, global_rngs=global_rngs)
    it = iter(loader)
    first = len(next(it))
    t0 = time.perf_counter()
    rest = sum(len(batch) for batch in it)
    wall = time.perf_counter() - t0
    if first + rest != entries:
        raise RuntimeError(f"the source read {first + rest} entries, expected {entries}")
    return rest / wall


def save_latencies(server: RedisServer, saves: int) -> list[float]:
    """Seconds per ``save_state_rank()`` while 2 workers wait on an empty stream."""
    stream = "bench-empty"
    server.client().delete(stream)
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=WORKERS, seed=0)
    loader = sl.SavableDataLoader(
        RedisStreamSource(server.url, stream, wc, follow=True), batch_size=None, worker_config=wc
    )
    it = iter(loader)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(next(it)), daemon=True)
    reader.start()
    time.sleep(1.0)  # the workers start and wait
    out = []
    for _ in range(saves):
        t0 = time.perf_counter()
        loader.save_state_rank()
        out.append(time.perf_counter() - t0)
        time.sleep(0.002)
    server.client().xadd(stream, {"i": b"0"})  # let the reader finish
    reader.join(30)
    M.close(it)
    if len(got) != 1:
        raise RuntimeError("the waiting reader did not get the entry")
    return out


def run(repeats: int, entries: int, size: int, saves: int) -> dict[str, Any]:
    stream = "bench-stream"
    with RedisServer() as server:
        M.log(f"streams: {entries} entries of {size} bytes in a redis-server on port {server.port}")
        fill(server, stream, entries, size)
        plain(server, stream, entries)  # warm-up runs
        through_source(server, stream, entries)
        rates = M.interleaved(
            {
                "plain": lambda r: plain(server, stream, entries),
                "source": lambda r: through_source(server, stream, entries),
                "source, global_rngs=()": lambda r: through_source(server, stream, entries, ()),
            },
            repeats,
        )
        M.log(f"streams: {saves} saves while {WORKERS} workers wait on an empty stream")
        latencies = save_latencies(server, saves)
    ratio = M.paired(rates["source"], rates["plain"])
    lean = M.paired(rates["source, global_rngs=()"], rates["plain"])
    save_ms = M.percentiles_ms(latencies)
    return {
        "entries": entries,
        "bytes": size,
        "workers": WORKERS,
        "repeats": repeats,
        "plain_per_s": M.spread(rates["plain"]),
        "source_per_s": M.spread(rates["source"]),
        "ratio": ratio,
        "lean_per_s": M.spread(rates["source, global_rngs=()"]),
        "lean_ratio": lean,
        "save_ms": save_ms,
        "targets": [
            {
                "figure": f"streams: RedisStreamSource ({WORKERS} workers) / plain redis client, entries per second",
                "value": ratio,
                "target": f">= {TARGET:g}",
                "result": M.verdict(ratio, TARGET, higher_is_better=True),
            },
            {
                "figure": (
                    f"streams: RedisStreamSource ({WORKERS} workers, global_rngs=()) / plain redis client, "
                    "entries per second"
                ),
                "value": lean,
                "target": f">= {TARGET:g}",
                "result": M.verdict(lean, TARGET, higher_is_better=True),
            },
            {
                "figure": "streams: save p99 (ms) while the workers wait on an empty stream",
                "value": M.spread([save_ms["p99"]]),
                "target": f"<= {SAVE_TARGET_MS:g}",
                "result": "PASS" if save_ms["p99"] <= SAVE_TARGET_MS else "MISS",
            },
        ],
    }


def render(out: dict[str, Any]) -> str:
    rows = [
        ["reader", "entries/s"],
        ["plain redis (1 process)", M.fmt_spread(out["plain_per_s"])],
        [f"RedisStreamSource ({out['workers']} workers)", M.fmt_spread(out["source_per_s"])],
        ["ratio", M.fmt_spread(out["ratio"])],
        [f"RedisStreamSource ({out['workers']} workers), global_rngs=()", M.fmt_spread(out["lean_per_s"])],
        ["ratio", M.fmt_spread(out["lean_ratio"])],
    ]
    s = out["save_ms"]
    saves = M.table(
        [["save while waiting", "p50 ms", "p99 ms", "max ms"], ["", *(f"{s[k]:.3f}" for k in ("p50", "p99", "max"))]]
    )
    return M.table(rows) + "\n\n" + saves


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description="RedisStreamSource against a plain redis client")
    parser.add_argument("--quick", action="store_true", help="3 repeats of 20000 entries, 100 saves")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5)")
    parser.add_argument("--entries", type=int, default=None, help="entries in the stream (default 100000)")
    parser.add_argument("--bytes", type=int, default=256, help="bytes of each entry's data field (default 256)")
    parser.add_argument("--saves", type=int, default=None, help="saves timed while waiting (default 500)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    out = run(
        args.repeats or (3 if args.quick else 5),
        args.entries or (20_000 if args.quick else 100_000),
        args.bytes,
        args.saves or (100 if args.quick else 500),
    )
    return M.finish(out, render(out), args.json)


if __name__ == "__main__":
    main()
