"""Benchmark LLM-pretraining packing: ``PackingDataset(strategy="best_fit")`` against a
nanochat-shaped loader loop, in one run.

Run from the repository root::

    python -m bench.bench_packing            # about 4 minutes on 2 cores
    python -m bench.bench_packing --quick    # about 1 minute (2 repeats: not a result)
    python -m bench.bench_packing --json bench/results/packing.json

It writes, in a temporary folder, a corpus of ``--docs`` text documents (12,000 by
default; words of a small vocabulary, lengths log-normal, median about 900 bytes) in 6
Parquet files of row groups of 250 rows, and indexes it (``index_folder``). The tokenizer
is byte-level (``list(text.encode())``, a list of ints as a BPE tokenizer returns; BOS is
token 256), the same function for both contenders.

* ``reference``: a loop shaped like nanochat's pretraining loader, written for this
  benchmark: Parquet row groups in file order (``ParquetFile.read_row_group``), their texts
  tokenized 128 at a time with BOS prepended into a list of documents, refilled whenever
  it holds fewer than 1,000; each row of ``T + 1`` tokens is filled best-fit (scan the list
  for the longest document that fits the remaining space; when none fits, crop the
  shortest to fill the row exactly); ``B`` rows become one ``torch.tensor``. One process.
* ``ours``: ``SavableDataLoader(BatchDataset(PackingDataset(MapDataset(
  ShardedFileDataset(folder, columns=["text"]), tokenize), T + 1, strategy="best_fit",
  buffer_size=1000, refill_chunk=128, bos=256), B), global_rngs=())`` with 0 and 2
  worker processes.

Figures (interleaved repeats, medians, ratios paired within a repeat; the machine is
shared: every ratio is measured side by side, never across runs):

* rows/s of ours / the reference at ``T = 512`` and ``2048`` (target >= 1.0), and ours with
  2 workers / ours with 0 (target >= 1.0);
* state bytes per worker after a few batches (``save_state_rank`` encoded, over the number
  of workers) with the buffer saved by key (the default) and as payload
  (``buffer_state="payload"``, what every state held before);
* restore: a fresh loader from ``restore_state_rank`` to its first batch, over a fresh
  loader's cold first batch (target <= 2);
* snapshot share: worker 0's run executed here as in a worker process, the CPU time of its
  snapshots (taken and encoded) over the loop's (target < 2 %), and their wall time over
  the loop's (the policy counts work in wall time: on a loaded machine it snapshots more
  often per CPU second).

``main(argv)`` returns the results as a dict.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:  # `python bench/bench_packing.py` puts bench/ first, not the root
    sys.path.insert(0, str(_REPO))

import numpy as np
import torch

import savable_loader as sl
from bench import measure as M
from savable_loader.pipeline.worker import WorkerRuntime
from savable_loader.sources import ShardedFileDataset, index_folder
from savable_loader.state.codec import encode_part
from savable_loader.wrappers import BatchDataset, MapDataset, PackingDataset

BOS = 256
BUFFER = 1000
CHUNK = 128
BATCH = 32
FILES = 6
ROW_GROUP = 250
TARGETS = {"rows": 1.0, "workers": 1.0, "restore": 2.0, "snapshot_share": 0.02, "state_bytes": 64 * 1024}


def tokenize(text: str) -> list[int]:
    """The benchmark's tokenizer: UTF-8 bytes as token ids."""
    return list(text.encode("utf-8"))


def tokenize_row(row: dict[str, Any]) -> list[int]:
    return tokenize(row["text"])


def write_corpus(folder: Path, docs: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    words = np.array(
        [
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
            "data",
            "model",
            "token",
        ]
    )
    folder.mkdir()
    per_file = -(-docs // FILES)
    for f in range(FILES):
        n = min(per_file, docs - f * per_file)
        counts = np.minimum(rng.lognormal(5.2, 0.9, n).astype(int) + 5, 4000)
        texts = [" ".join(rng.choice(words, c)) for c in counts]
        pq.write_table(pa.table({"text": texts}), folder / f"shard-{f:02d}.parquet", row_group_size=ROW_GROUP)
    index_folder(folder, progress=False)


# -- the reference loop ---------------------------------------------------------------------


def reference_batches(folder: Path, row_length: int, batch: int) -> Iterator[torch.Tensor]:
    """A nanochat-shaped best-fit loop (one pass over the corpus)."""
    import pyarrow.parquet as pq

    def chunks() -> Iterator[list[str]]:
        for path in sorted(folder.glob("*.parquet")):
            pf = pq.ParquetFile(path)
            for g in range(pf.num_row_groups):
                texts = pf.read_row_group(g, columns=["text"]).column("text").to_pylist()
                for i in range(0, len(texts), CHUNK):
                    yield texts[i : i + CHUNK]

    source = chunks()
    buffer: list[list[int]] = []
    exhausted = False
    while True:
        rows = []
        for _ in range(batch):
            row: list[int] = []
            while len(row) < row_length:
                while len(buffer) < BUFFER and not exhausted:
                    texts = next(source, None)
                    if texts is None:
                        exhausted = True
                        break
                    buffer.extend([BOS, *tokenize(t)] for t in texts)
                if not buffer:
                    return
                remaining = row_length - len(row)
                best, best_len = -1, 0
                for i, doc in enumerate(buffer):
                    n = len(doc)
                    if best_len < n <= remaining:
                        best, best_len = i, n
                if best >= 0:
                    row.extend(buffer.pop(best))
                else:
                    shortest = min(range(len(buffer)), key=lambda i: len(buffer[i]))
                    row.extend(buffer.pop(shortest)[:remaining])
            rows.append(row)
        yield torch.tensor(rows, dtype=torch.long)


# -- ours -----------------------------------------------------------------------------------


def pipeline(folder: Path, row_length: int, workers: int, buffer_state: str = "auto") -> BatchDataset:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=workers, seed=0)
    docs = MapDataset(ShardedFileDataset(folder, wc, columns=["text"]), tokenize_row)
    packed = PackingDataset(
        docs,
        row_length,
        strategy="best_fit",
        buffer_size=BUFFER,
        refill_chunk=CHUNK,
        bos=BOS,
        buffer_state=buffer_state,
    )
    return BatchDataset(packed, BATCH)


def loader(folder: Path, row_length: int, workers: int, buffer_state: str = "auto") -> sl.SavableDataLoader:
    ds = pipeline(folder, row_length, workers, buffer_state)
    kw: dict[str, Any] = {"multiprocessing_context": "fork"} if workers else {}
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=ds.worker_config, global_rngs=(), **kw)


def _rows(batches: Any, limit: int) -> int:
    rows = 0
    for b in batches:
        rows += len(b)
        if rows >= limit:
            break
    return rows


def throughput(folder: Path, row_length: int, limit: int, repeats: int) -> dict[str, Any]:
    """rows/s of each contender (wall clock, and per CPU second of the main process: the
    training process's cost), median over interleaved repeats, and the paired ratios."""
    runs: dict[str, Callable[[], int]] = {
        "reference": lambda: _rows(reference_batches(folder, row_length, BATCH), limit),
        "ours_w0": lambda: _rows(loader(folder, row_length, 0), limit),
        "ours_w2": lambda: _rows(loader(folder, row_length, 2), limit),
    }
    rates: dict[str, list[float]] = {n: [] for n in runs}
    cpu_rates: dict[str, list[float]] = {n: [] for n in runs}
    names = list(runs)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order if r % 2 == 0 else order[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            rows = runs[name]()
            rates[name].append(rows / (time.perf_counter() - t0))
            cpu_rates[name].append(rows / (time.process_time() - c0))

    def ratio(table: dict[str, list[float]], a: str, b: str) -> dict[str, float]:
        return _spread([x / y for x, y in zip(table[a], table[b])])

    return {
        "rows_per_s": {n: statistics.median(v) for n, v in rates.items()},
        "rows_per_main_cpu_s": {n: statistics.median(v) for n, v in cpu_rates.items()},
        "ratios": {
            "w0_vs_ref": ratio(rates, "ours_w0", "reference"),
            "w2_vs_ref": ratio(rates, "ours_w2", "reference"),
            "w2_vs_w0": ratio(rates, "ours_w2", "ours_w0"),
            "cpu_w0_vs_ref": ratio(cpu_rates, "ours_w0", "reference"),
            "cpu_w2_vs_w0": ratio(cpu_rates, "ours_w2", "ours_w0"),
        },
    }


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def state_bytes(folder: Path, row_length: int, workers: int, buffer_state: str, batches: int = 6) -> float:
    """Encoded bytes of a rank state per worker after ``batches`` batches."""
    ld = loader(folder, row_length, workers, buffer_state)
    it = iter(ld)
    for _ in range(batches):
        next(it)
    state = ld.save_state_rank()
    del it
    return len(encode_part(state)) / max(workers, 1)


def restore_vs_cold(folder: Path, row_length: int, workers: int, repeats: int, at: int = 10) -> dict[str, Any]:
    """Seconds from a fresh loader to its first batch, cold and restored from a state
    saved after ``at`` batches (each restored first batch checked against the run's)."""
    ld = loader(folder, row_length, workers)
    it = iter(ld)
    for _ in range(at):
        next(it)
    state = ld.save_state_rank()
    want = next(it)
    del it
    cold, restored = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        first = next(iter(loader(folder, row_length, workers)))
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fresh = loader(folder, row_length, workers)
        fresh.restore_state_rank(state)
        first = next(iter(fresh))
        restored.append(time.perf_counter() - t0)
        if not torch.equal(first, want):
            raise SystemExit("the restored first batch differs from the uninterrupted run's")
    return {
        "cold_s": statistics.median(cold),
        "restore_s": statistics.median(restored),
        "ratio": _spread([r / c for r, c in zip(restored, cold)]),
    }


def snapshot_share(folder: Path, row_length: int, limit: int) -> dict[str, Any]:
    """Worker 0 of 2 run here as in a worker process (snapshots taken and encoded): the
    CPU share of its snapshots over ``limit`` rows."""
    ds = pipeline(folder, row_length, 2)
    runtime = WorkerRuntime(ds, ds.worker_config, max_in_flight=4, in_process=False)
    costs: list[float] = []
    snapshot = runtime._snapshot

    def timed(index: int) -> float:
        cost = snapshot(index)
        costs.append(cost)
        return cost

    runtime._snapshot = timed  # type: ignore[method-assign]
    c0, t0 = time.thread_time(), time.perf_counter()
    rows = 0
    for _ in runtime.run(0, 0, None):
        runtime.outbox = None  # (a worker process sends it with the item)
        rows += BATCH
        if rows >= limit:
            break
    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    return {
        "snapshots": len(costs),
        "share": sum(costs) / cpu,
        "wall_share": runtime.snapshot_seconds / wall,
        "cost_ms": statistics.median(costs) * 1e3 if costs else 0.0,
    }


def run(docs: int, repeats: int) -> dict[str, Any]:
    """Every figure of the module docstring over a corpus of ``docs`` documents."""
    out: dict[str, Any] = {"docs": docs, "repeats": repeats, "batch": BATCH, "buffer": BUFFER, "chunk": CHUNK}
    targets = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "corpus"
        write_corpus(folder, docs)
        for t in (512, 2048):
            row = t + 1
            limit = 10**9  # the whole corpus
            M.log(f"packing T={t}: rows/s, {repeats} interleaved repeats")
            _rows(reference_batches(folder, row, BATCH), BATCH)  # warm-up: page cache, imports
            res = throughput(folder, row, limit, repeats)
            res["state_bytes"] = {
                f"{mode}_w{w}": state_bytes(folder, row, w, mode) for mode in ("auto", "payload") for w in (0, 2)
            }
            res["restore_w0"] = restore_vs_cold(folder, row, 0, repeats)
            res["snapshots"] = snapshot_share(folder, row, limit)
            out[f"T{t}"] = res
            q = res["ratios"]
            for figure, value, target, higher in (
                (f"packing T={t}: ours w0 / reference rows/s", q["w0_vs_ref"], TARGETS["rows"], True),
                (f"packing T={t}: ours w2 / ours w0 rows/s", q["w2_vs_w0"], TARGETS["workers"], True),
                (f"packing T={t}: restore / cold first batch", res["restore_w0"]["ratio"], TARGETS["restore"], False),
            ):
                targets.append(
                    {
                        "figure": figure,
                        "value": value,
                        "target": f"{'>=' if higher else '<='} {target:g}",
                        "result": M.verdict(value, target, higher_is_better=higher),
                    }
                )
    out["targets"] = targets
    return out


def render(out: dict[str, Any]) -> str:
    return "\n".join(render_one(t, out[f"T{t}"]) for t in (512, 2048))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small corpus, 2 repeats (a smoke test)")
    parser.add_argument("--docs", type=int, default=None, help="documents in the corpus (default 12000)")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 5)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    out = run(args.docs or (3000 if args.quick else 12000), args.repeats or (2 if args.quick else 5))
    return M.finish(out, render(out), args.json)


def render_one(t: int, res: dict[str, Any]) -> str:
    r, q = res["rows_per_s"], res["ratios"]
    fmt = lambda s: f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})"
    sb, rs, sn = res["state_bytes"], res["restore_w0"], res["snapshots"]
    return "\n".join(
        [
            f"T={t}: rows/s reference {r['reference']:.0f}, ours w0 {r['ours_w0']:.0f}, ours w2 {r['ours_w2']:.0f}",
            (
                f"  ours w0 / reference {fmt(q['w0_vs_ref'])}   ours w2 / reference {fmt(q['w2_vs_ref'])}   "
                f"w2 / w0 {fmt(q['w2_vs_w0'])}"
            ),
            (
                f"  per CPU second of the main process: ours w0 / reference {fmt(q['cpu_w0_vs_ref'])}   "
                f"w2 / w0 {fmt(q['cpu_w2_vs_w0'])}"
            ),
            (
                f"  state bytes per worker: keys {sb['auto_w0']:.0f} (w0) {sb['auto_w2']:.0f} (w2); "
                f"payload {sb['payload_w0']:.0f} (w0) {sb['payload_w2']:.0f} (w2)"
            ),
            (
                f"  restore to first batch {rs['restore_s'] * 1e3:.0f} ms, cold {rs['cold_s'] * 1e3:.0f} ms: "
                f"{fmt(rs['ratio'])}"
            ),
            (
                f"  snapshots: {sn['share'] * 100:.2f}% of worker CPU, {sn['wall_share'] * 100:.2f}% of its wall time "
                f"({sn['snapshots']} taken, "
                f"{sn['cost_ms']:.2f} ms each)"
            ),
        ]
    )


if __name__ == "__main__":
    main()
