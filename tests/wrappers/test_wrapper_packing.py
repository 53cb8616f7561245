"""PackingDataset: rows exactly full, every token accounted for (kept, cropped or dropped
at the end), greedy keeps document order, best_fit starts every row with BOS; resume and
restore keys."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.state.codec import encode_part
from savable_loader.wrappers import MapDataset, PackingDataset
from tests.common import RangeSource, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES,
    check_restore_samples,
    iterate_with_keys,
    make_loader,
    make_wc,
    round_robin,
    set_snapshot_policy,
    worker_values,
)

pytestmark = pytest.mark.timeout(120)

N = 14
ROW = 8
BOS = -1


def doc_length(v: int) -> int:
    return (v * 7) % 13 + 1  # 1 .. 13: shorter and longer than a row


def document(v: int) -> torch.Tensor:
    """Document ``v``: tokens ``v * 100 + i`` (unique, so every token can be traced), the
    last one plus a draw from torch's RNG (re-seeded from the key) times 100 000."""
    doc = v * 100 + torch.arange(doc_length(v))
    doc[-1] += int(torch.randint(1, 9, ())) * 100_000
    return doc


def strip(t: torch.Tensor) -> torch.Tensor:
    """Tokens without their random part (drawn in the pipeline, not in the test)."""
    return torch.remainder(t, 100_000)


def docs(wc, n: int = N, as_list: bool = False):
    fn = (lambda x: document(int(x[0])).tolist()) if as_list else (lambda x: document(int(x[0])))
    return MapDataset(RangeSource(n, wc), fn)


def packed(num_workers: int, strategy: str, n: int = N, **kw) -> PackingDataset:
    return PackingDataset(docs(make_wc(num_workers), n), ROW, strategy=strategy, **kw)


def worker_rows(ds: PackingDataset, worker: int) -> tuple[list[torch.Tensor], list, int, int]:
    """Rows, keys and the two counters of one worker's epoch, iterated in-process."""
    pairs = iterate_with_keys(ds, worker=worker)
    return [r for r, _ in pairs], [k for _, k in pairs], ds.tokens_cropped, ds.tokens_dropped


CASES = [
    pytest.param(*case.values, strategy, id=f"{case.id}-{strategy}")
    for case in RESUME_CASES
    for strategy in ("greedy", "best_fit")
    if case.values[0] == 0 or (strategy == "best_fit" and case.values[1] == "every")
]


@pytest.mark.parametrize(("num_workers", "policy", "strategy"), CASES)
def test_resume_at_every_step(num_workers, policy, strategy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    factory = lambda: make_loader(packed(num_workers, strategy, buffer_size=4))
    epoch_len = len(list(factory()))
    steps = None if num_workers == 0 else [0, 1, epoch_len // 2, epoch_len, epoch_len + 3, 2 * epoch_len]
    assert check_resume_everywhere(factory, 2, steps=steps) >= 7


@pytest.mark.parametrize("bos", [None, BOS])
@pytest.mark.parametrize("workers", [1, 2])
def test_greedy_keeps_every_token_in_order(workers, bos):
    ds = packed(workers if workers > 1 else 0, "greedy", bos=bos)
    total = 0
    for w in range(workers):
        rows, keys, cropped, dropped = worker_rows(ds, w)
        stream = [document(v) for v in worker_values(N, w, workers)]
        if bos is not None:
            stream = [torch.cat([torch.tensor([bos]), d]) for d in stream]
        flat = torch.cat(stream)
        assert all(r.shape == (ROW,) and r.dtype == torch.long for r in rows)
        assert cropped == 0 and dropped == len(flat) % ROW and dropped < ROW
        assert torch.equal(strip(torch.cat(rows)), strip(flat[: len(flat) - dropped]))
        # the keys name the pieces each row was made of
        for row, key in zip(rows, keys):
            assert sum(b - a for _, a, b in key) == ROW
        total += len(rows) * ROW + dropped
    assert total == sum(doc_length(v) + (bos is not None) for v in range(N))


@pytest.mark.parametrize("buffer_size", [1, 3, 16])
@pytest.mark.parametrize("workers", [1, 2])
def test_best_fit_accounts_for_every_token(workers, buffer_size):
    ds = packed(workers if workers > 1 else 0, "best_fit", bos=BOS, buffer_size=buffer_size)
    for w in range(workers):
        rows, keys, cropped, dropped = worker_rows(ds, w)
        values = worker_values(N, w, workers)
        assert rows and all(r.shape == (ROW,) for r in rows)
        assert all(int(r[0]) == BOS for r in rows)  # every row starts with a document start
        seen: dict[int, int] = {}
        want_cropped = 0
        for row, key in zip(rows, keys):
            pieces = []
            for k, start, stop in key:
                v = k
                assert start == 0 and v in values and v not in seen  # whole documents, once
                full = torch.cat([torch.tensor([BOS]), document(v)])
                pieces.append(full[:stop])
                seen[v] = stop
                want_cropped += len(full) - stop
                # a document is only cropped when it fills the row's end
                assert stop == len(full) or (k, start, stop) == tuple(key[-1])
            assert torch.equal(strip(row), strip(torch.cat(pieces)))
        assert cropped == want_cropped
        lengths = {v: doc_length(v) + 1 for v in values}
        assert sum(seen.values()) + cropped + dropped == sum(lengths.values())
        # what was never placed is the partial last row, dropped, less than a row
        assert dropped == sum(lengths[v] for v in values if v not in seen) and dropped < ROW


def test_best_fit_prefers_the_longest_fitting_document():
    wc = make_wc(0)
    lengths = [5, 3, 2, 6, 4]
    ds = PackingDataset(
        MapDataset(RangeSource(5, wc), lambda x: [int(x[0])] * lengths[int(x[0])]),
        8,
        strategy="best_fit",
        buffer_size=5,
    )
    rows = [r.tolist() for r in iter(ds)]
    # row 1: 6 (longest <= 8), then 2 (longest <= 2); row 2: 5 then 3; then 4 is left: dropped
    assert rows == [[3] * 6 + [2] * 2, [0] * 5 + [1] * 3]
    assert ds.tokens_dropped == 4 and ds.tokens_cropped == 0


def test_loader_rows_are_the_workers_rows():
    for strategy in ("greedy", "best_fit"):
        per_worker = [worker_rows(packed(2, strategy), w)[0] for w in range(2)]
        got = epochs_of(make_loader(packed(2, strategy)), 1)[0]
        want = round_robin(per_worker)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_lists_and_counters_in_the_state():
    wc = make_wc(0)
    ds = PackingDataset(docs(wc, as_list=True), ROW, strategy="best_fit", buffer_size=2)
    rows = list(ds)
    assert rows and all(r.dtype == torch.long and r.shape == (ROW,) for r in rows)
    fields = ds.save_state().fields
    assert fields["tokens_cropped"] == ds.tokens_cropped > 0
    assert fields["tokens_dropped"] == ds.tokens_dropped


@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
def test_restore_sample(strategy):
    assert check_restore_samples(lambda: packed(0, strategy, bos=BOS, buffer_size=3), epochs=2) == 8


def test_bad_keys_and_documents():
    ds = packed(0, "greedy")
    for bad in (3, [], [[0, 0]], [[0, 2, 1]], [[0, 0, 99]], [[0, "a", 2]]):
        with pytest.raises(RestoreKeyError, match="PackingDataset key"):
            ds.restore_sample(bad)
    wc = make_wc(0)
    with pytest.raises(LoaderUsageError, match="documents must be 1-D tensors, NumPy arrays or lists of ints, got str"):
        list(PackingDataset(MapDataset(RangeSource(2, wc), lambda x: "text"), 4))
    with pytest.raises(LoaderUsageError, match=r"documents must be 1-D, got a tensor of shape \(2, 2\)"):
        list(PackingDataset(MapDataset(RangeSource(2, wc), lambda x: torch.zeros(2, 2)), 4))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"row_length": 0}, "row_length must be a positive int, got 0"),
        ({"row_length": 4, "strategy": "first_fit"}, "strategy must be one of"),
        ({"row_length": 4, "buffer_size": 0}, "buffer_size must be a positive int, got 0"),
        ({"row_length": 4, "bos": 1.0}, "bos must be None or an int token id, got 1.0"),
    ],
)
def test_bad_arguments(kw, message):
    with pytest.raises(LoaderUsageError, match=message):
        PackingDataset(docs(make_wc(0)), **kw)


def test_config():
    ds = PackingDataset(docs(make_wc(0)), 4, strategy="best_fit", buffer_size=2, bos=0)
    assert ds.config() == {"row_length": 4, "strategy": "best_fit", "buffer_size": 2, "refill_chunk": 1, "bos": 0}


# -- refill chunk, document kinds, BOS, states of keys ------------------------------------


def corpus(n: int, seed: int = 0) -> list[list[int]]:
    """``n`` documents of varied lengths (a long tail), tokens unique per document."""
    rng = random.Random(seed)
    return [[v * 10_000 + i for i in range(min(int(rng.lognormvariate(4.5, 1.0)) + 1, 9_000))] for v in range(n)]


def nanochat_style_rows(docs: list[list[int]], row: int, buffer_size: int, chunk: int, bos: int) -> list[list[int]]:
    """A nanochat-style best-fit loop, written for the test: documents with BOS prepended
    go into a list; whenever it holds fewer than ``buffer_size``, ``chunk`` more are
    appended; a row takes the longest document that fits (scanning the list, first of
    equals), and when none fits crops the shortest (first of equals) to fill the row."""
    stream = iter(docs)
    buffer: list[list[int]] = []
    rows: list[list[int]] = []
    exhausted = False
    while True:
        out: list[int] = []
        while len(out) < row:
            while len(buffer) < buffer_size and not exhausted:
                for _ in range(chunk):
                    doc = next(stream, None)
                    if doc is None:
                        exhausted = True
                        break
                    buffer.append([bos, *doc])
            if not buffer:
                return rows
            remaining = row - len(out)
            best, best_len = -1, 0
            for i, doc in enumerate(buffer):
                if best_len < len(doc) <= remaining:
                    best, best_len = i, len(doc)
            if best >= 0:
                out.extend(buffer.pop(best))
            else:
                shortest = min(range(len(buffer)), key=lambda i: len(buffer[i]))
                out.extend(buffer.pop(shortest)[:remaining])
        rows.append(out)


def corpus_packing(docs: list[list[int]], row: int, wc=None, kind=list, keyed: bool = True, **kw) -> PackingDataset:
    wc = wc or make_wc(0)
    convert = {list: lambda d: d, np.ndarray: np.array, torch.Tensor: torch.tensor}[kind]
    source = MapDataset(RangeSource(len(docs), wc, keyed=keyed), lambda x: convert(docs[int(x[0])]))
    return PackingDataset(source, row, strategy="best_fit", **kw)


@pytest.mark.parametrize(("row", "buffer_size", "chunk"), [(512, 1000, 128), (64, 50, 7), (128, 30, 1)])
def test_refill_chunk_reproduces_a_nanochat_style_loop(row, buffer_size, chunk):
    docs = corpus(3000)
    want = nanochat_style_rows(docs, row, buffer_size, chunk, bos=7)
    got = [r.tolist() for r in corpus_packing(docs, row, buffer_size=buffer_size, refill_chunk=chunk, bos=7)]
    assert len(got) == len(want) > 100 and got == want
    if chunk > 1:  # a buffer of exactly buffer_size makes other rows
        assert [r.tolist() for r in corpus_packing(docs, row, buffer_size=buffer_size, bos=7)] != want


@pytest.mark.parametrize("kind", [np.ndarray, torch.Tensor])
@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
def test_lists_arrays_and_tensors_make_the_same_rows(kind, strategy):
    docs = corpus(300)
    make = lambda k: PackingDataset(
        MapDataset(
            RangeSource(len(docs), make_wc(0)),
            lambda x: {list: list, np.ndarray: np.array}.get(k, torch.tensor)(docs[int(x[0])]),
        ),
        100,
        strategy=strategy,
        buffer_size=20,
        bos=3,
    )
    want = list(make(list))
    got = list(make(kind))
    assert len(got) == len(want) > 50
    assert all(torch.equal(a, b) and a.dtype == b.dtype == torch.long for a, b in zip(got, want))


def test_numpy_rows_keep_the_dtype():
    wc = make_wc(0)
    ds = PackingDataset(MapDataset(RangeSource(20, wc), lambda x: np.arange(5, dtype=np.int32)), 8, bos=9)
    rows = list(ds)
    assert rows and all(r.dtype == torch.int32 for r in rows)
    assert rows[0].tolist() == [9, 0, 1, 2, 3, 4, 9, 0]


@pytest.mark.parametrize("kind", [list, np.ndarray, torch.Tensor])
def test_documents_that_start_with_bos_are_refused(kind):
    docs = [[1, 5, 6], [1, 7]]
    with pytest.raises(LoaderUsageError, match="bos=1: a document already starts with token 1"):
        list(corpus_packing(docs, 4, kind=kind, bos=1))
    assert len(list(corpus_packing(docs, 4, kind=kind, bos=2))) == 1  # another BOS: fine


def test_a_state_names_documents_by_key_where_the_source_can_fetch_them():
    docs = corpus(3000)
    sizes = {}
    for keyed in (True, False):
        ds = corpus_packing(docs, 512, keyed=keyed, buffer_size=1000, bos=7)
        it = iter(ds)
        for _ in range(5):
            next(it)
        state = ds.save_state()
        assert state.fields["held"] == ("keys" if keyed else "payload")
        assert (state.fields["buffer"] is None) == keyed and len(json.loads(state.fields["keys"])) >= 999
        sizes[keyed] = len(encode_part(state))
    assert sizes[True] < 16 * 1024 < 200 * 1024 < sizes[False]
    forced = corpus_packing(docs, 512, buffer_size=1000, bos=7, buffer_state="payload")
    next(iter(forced))
    assert forced.save_state().fields["held"] == "payload"


@pytest.mark.parametrize("buffer_state", ["auto", "payload"])
@pytest.mark.parametrize("strategy", ["greedy", "best_fit"])
def test_resume_of_a_corpus_at_every_step(strategy, buffer_state, monkeypatch):
    """Exact resume over varied documents with a refill chunk, states of keys (which a
    restore fetches and re-maps) and of payload; in-process."""
    set_snapshot_policy(monkeypatch, "every")
    docs = corpus(40, seed=1)
    factory = lambda: make_loader(
        corpus_packing(docs, 64, buffer_size=9, refill_chunk=4, bos=7, buffer_state=buffer_state)
        if strategy == "best_fit"
        else PackingDataset(
            MapDataset(RangeSource(len(docs), make_wc(0)), lambda x: docs[int(x[0])]),
            64,
            bos=7,
            buffer_state=buffer_state,
        )
    )
    assert check_resume_everywhere(factory, 2) > 60


def _parquet_tokens(row: dict) -> list[int]:
    """A document per Parquet row, its last token drawn from torch's RNG (seeded from the
    row's key: a restore that fetches and re-maps the row draws it again)."""
    k = row["id"]
    return [k * 100 + i for i in range(1 + k * 7 % 13)] + [int(torch.randint(1, 9, ())) * 10_000]


@pytest.mark.parametrize(("num_workers", "strategy"), [(0, "best_fit"), (0, "greedy"), (2, "best_fit")])
def test_resume_over_parquet_rows_fetched_again(num_workers, strategy, tmp_path, monkeypatch):
    """States of keys over a ShardedFileDataset: a restore reads the buffered rows again
    and re-tokenizes them; every save point continues as the uninterrupted run."""
    from savable_loader.sources import ShardedFileDataset, index_folder
    from tests.shard_writers import write_parquet_folder

    pytest.importorskip("pyarrow")
    set_snapshot_policy(monkeypatch, "every")
    folder = write_parquet_folder(tmp_path / "pq", sizes=[15, 9, 12, 12], row_group=4)
    index_folder(folder, progress=False)

    def factory():
        wc = make_wc(num_workers)
        docs = MapDataset(ShardedFileDataset(folder, wc, columns=["id"]), _parquet_tokens)
        return make_loader(PackingDataset(docs, 8, strategy=strategy, buffer_size=5, refill_chunk=2, bos=-1))

    loader = factory()
    it = iter(loader)
    next(it)
    held = {w.dataset.fields["held"] for w in loader.save_state_rank().position.workers if w.dataset is not None}
    assert held == {"keys"}
    del it
    epoch_len = len(list(factory()))
    steps = None if num_workers == 0 else [0, 1, epoch_len // 2, epoch_len, epoch_len + 3]
    assert check_resume_everywhere(factory, 2, steps=steps) >= 5


class VanishingSource(RangeSource):
    """A source whose read samples may be gone later (as a producer's stream)."""

    samples_may_vanish = True


@pytest.mark.parametrize(("buffer_state", "held"), [("auto", "payload"), ("keys", "keys"), ("payload", "payload")])
def test_sources_whose_samples_may_vanish_save_payload_unless_told(buffer_state, held):
    wc = make_wc(0)
    ds = PackingDataset(
        MapDataset(VanishingSource(30, wc), lambda x: [int(x[0])] * 5),
        8,
        strategy="best_fit",
        buffer_size=4,
        buffer_state=buffer_state,
    )
    next(iter(ds))
    assert ds.save_state().fields["held"] == held
    with pytest.raises(LoaderUsageError, match="buffer_state must be one of"):
        PackingDataset(ds.dataset, 8, buffer_state="positions")
