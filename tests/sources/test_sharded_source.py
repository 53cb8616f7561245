"""ShardedFileDataset: formats, coverage per epoch over ranks x workers, deterministic
order, the three rank-balancing strategies, resume at every step (by seeking), restore
keys, and clear errors for broken metadata and shards."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import savable_loader as sl
import savable_loader.sources.sharded as sharded_module
from savable_loader.config import _ActiveWorker
from savable_loader.dataset.values import plain_dataset_state
from savable_loader.errors import DataError, LoaderUsageError, RestoreKeyError
from savable_loader.sources import ShardedFileDataset, open_shard, read_metadata, write_shards
from savable_loader.state import decode, encode
from savable_loader.state.codec import decode_part, encode_part
from savable_loader.state.schema import DatasetState
from tests.common import assert_same, assert_streams, check_resume_everywhere, epochs_of
from tests.wrapper_common import RESUME_CASES, make_loader, resume_steps, set_snapshot_policy

pytestmark = pytest.mark.timeout(180)

SIZES = [7, 3, 10, 4, 6]  # 30 samples: 15 per rank over 2 ranks, 8 + 7 per worker
UNEVEN = [7, 3, 10, 4, 7]  # 31 samples


def npy_shards(sizes: list[int]) -> list[np.ndarray]:
    """Row j of the global sequence is [j, 10 j, 100 j] (int64)."""
    out, base = [], 0
    for n in sizes:
        ids = np.arange(base, base + n, dtype=np.int64)
        out.append(np.stack([ids, 10 * ids, 100 * ids], axis=1))
        base += n
    return out


def pt_shards(sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    return [{"id": torch.from_numpy(a[:, 0].copy()), "x": torch.from_numpy(a).float() / 7} for a in npy_shards(sizes)]


def jsonl_shards(sizes: list[int]) -> list[list[Any]]:
    return [[{"id": int(r[0]), "text": f"sample {r[0]}", "tags": [int(r[1])]} for r in a] for a in npy_shards(sizes)]


MAKERS = {".npy": npy_shards, ".pt": pt_shards, ".jsonl": jsonl_shards}


def sample_id(sample: Any) -> int:
    if isinstance(sample, torch.Tensor):
        return int(sample[0])
    return int(sample["id"])


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for fmt, make in MAKERS.items():
        out[fmt] = tmp_path_factory.mktemp(f"even{fmt}")
        write_shards(out[fmt], make(SIZES), fmt=fmt)
    out["uneven"] = tmp_path_factory.mktemp("uneven")
    write_shards(out["uneven"], npy_shards(UNEVEN))
    return out


def wconf(rank: int = 0, world: int = 1, workers: int = 0, seed: int = 5) -> sl.WorkerConfig:
    return sl.WorkerConfig(rank=rank, world_size=world, num_workers=workers, seed=seed)


def worker_stream(ds: ShardedFileDataset, worker: int, epoch: int) -> tuple[list[Any], list[Any]]:
    """One epoch of one worker, iterated in this process: (samples, restore keys)."""
    samples, keys = [], []
    with _ActiveWorker(worker, epoch):
        ds.reset_state_deep()
        for s in ds:
            samples.append(s)
            keys.append(ds.sample_key)
    return samples, keys


def epoch_ids(folder: Path, world: int, workers: int, epoch: int, **kw: Any) -> list[list[int]]:
    """Per rank, the ids its workers read in ``epoch`` (worker 0's first, then worker 1's...)."""
    per_rank = []
    for rank in range(world):
        ds = ShardedFileDataset(folder, wconf(rank, world, workers), **kw)
        per_rank.append([sample_id(s) for w in range(max(workers, 1)) for s in worker_stream(ds, w, epoch)[0]])
    return per_rank


# -- formats and layout ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(MAKERS))
def test_formats_read_back_exactly(folders, fmt):
    ds = ShardedFileDataset(folders[fmt], wconf(), shuffle=False)
    samples, keys = worker_stream(ds, 0, 0)
    written = [
        row
        for shard in MAKERS[fmt](SIZES)
        for row in (
            [{k: v[i] for k, v in shard.items()} for i in range(len(shard["id"]))]
            if fmt == ".pt"
            else list(torch.from_numpy(shard))
            if fmt == ".npy"
            else shard
        )
    ]
    assert_streams(samples, written, fmt)
    assert keys[:8] == [[0, i, 0] for i in range(7)] + [[1, 0, 0]]


def test_metadata_format(folders):
    meta = json.loads((folders[".npy"] / "metadata.json").read_text())
    assert meta == {"format": 1, "shards": [{"path": f"shard-{i:05d}.npy", "samples": n} for i, n in enumerate(SIZES)]}
    assert [s.samples for s in read_metadata(folders[".npy"]).shards] == SIZES
    assert len(open_shard(folders[".jsonl"] / "shard-00002.jsonl", expected=10)) == 10


@pytest.mark.parametrize("fmt", list(MAKERS))
def test_each_sample_once_per_epoch_over_2_ranks_x_2_workers(folders, fmt):
    orders = []
    for epoch in range(3):
        per_rank = epoch_ids(folders[fmt], 2, 2, epoch)
        assert [len(r) for r in per_rank] == [15, 15]
        flat = per_rank[0] + per_rank[1]
        assert sorted(flat) == list(range(30)), f"epoch {epoch}"
        orders.append(flat)
    assert orders[0] != orders[1] != orders[2] != orders[0]  # reshuffled every epoch
    assert epoch_ids(folders[fmt], 2, 2, 1) == [orders[1][:15], orders[1][15:]]  # deterministic


def test_coverage_through_loaders(folders):
    """One loader per rank, 2 worker processes each (no torch.distributed needed)."""
    got = []
    for rank in range(2):
        ds = ShardedFileDataset(folders[".npy"], wconf(rank, 2, 2))
        got.append([[sample_id(s) for s in e] for e in epochs_of(make_loader(ds), 2)])
    for epoch in range(2):
        direct = epoch_ids(folders[".npy"], 2, 2, epoch)
        assert sorted(got[0][epoch] + got[1][epoch]) == list(range(30))
        for rank in range(2):
            assert sorted(got[rank][epoch]) == sorted(direct[rank])


def test_order_depends_on_seed_and_shuffle(folders):
    folder = folders[".npy"]
    a = ShardedFileDataset(folder, wconf(seed=1))
    b = ShardedFileDataset(folder, wconf(seed=2))
    ids_a = [sample_id(s) for s in worker_stream(a, 0, 0)[0]]
    assert ids_a == [sample_id(s) for s in worker_stream(ShardedFileDataset(folder, wconf(seed=1)), 0, 0)[0]]
    assert ids_a != [sample_id(s) for s in worker_stream(b, 0, 0)[0]]
    assert sorted(ids_a) == list(range(30))
    # samples of a shard come out together: the order is a shuffle of shards, then of rows
    runs = [next(i for i, end in enumerate(np.cumsum(SIZES)) if x < end) for x in ids_a]
    assert sum(1 for i in range(1, 30) if runs[i] != runs[i - 1]) == len(SIZES) - 1
    plain = ShardedFileDataset(folder, wconf(0, 2, 2), shuffle=False)
    assert [sample_id(s) for s in worker_stream(plain, 1, 3)[0]] == list(range(8, 15))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_strategies_on_an_uneven_folder(folders, world):
    folder = folders["uneven"]
    with pytest.raises(DataError) as info:
        ShardedFileDataset(folder, wconf(0, world))
    text = str(info.value)
    assert f"31 samples in 5 shards do not split evenly over world_size={world} ranks" in text
    for rank in range(world):
        assert f"rank {rank} would read {31 // world + (rank < 31 % world)} samples (from shard-" in text
    assert "strategy='oversampling'" in text and "'undersampling'" in text
    for epoch in range(2):
        over = epoch_ids(folder, world, 2, epoch, strategy="oversampling")
        assert {len(r) for r in over} == {-(-31 // world)}
        flat = [x for r in over for x in r]
        assert set(flat) == set(range(31))
        counts = Counter(flat)
        assert sum(c - 1 for c in counts.values()) == len(flat) - 31 == -31 % world
        under = epoch_ids(folder, world, 2, epoch, strategy="undersampling")
        assert {len(r) for r in under} == {31 // world}
        flat = [x for r in under for x in r]
        assert len(set(flat)) == len(flat) == 31 - 31 % world


def test_oversampled_samples_have_their_own_keys(folders):
    ds = ShardedFileDataset(folders["uneven"], wconf(1, 2, 0), strategy="oversampling")
    samples, keys = worker_stream(ds, 0, 0)
    assert len(samples) == 16 and [k[2] for k in keys] == [0] * 15 + [1]
    first = ShardedFileDataset(folders["uneven"], wconf(0, 2, 0), strategy="oversampling")
    s0, k0 = worker_stream(first, 0, 0)
    assert keys[-1][:2] == k0[0][:2]  # the wrapped sample is the first of the epoch's sequence
    assert_same(samples[-1], s0[0])


# -- resume -----------------------------------------------------------------------------


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES)
def test_resume_at_every_step(folders, num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)

    def factory():
        return make_loader(ShardedFileDataset(folders[".npy"], wconf(1, 2, num_workers)))

    assert check_resume_everywhere(factory, 2, steps=resume_steps(num_workers, 15)) >= 7


@pytest.mark.parametrize("fmt", [".pt", ".jsonl"])
def test_resume_other_formats(folders, fmt, monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    factory = lambda: make_loader(ShardedFileDataset(folders[fmt], wconf(0, 1, 0), strategy="exact"))
    steps = [0, 1, 5, 9, 10, 11, 20, 29, 30, 31, 44, 59, 60]  # both epochs, shard and epoch edges
    assert check_resume_everywhere(factory, 2, steps=steps) == 15


def test_resume_oversampling_across_epochs(folders, monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    factory = lambda: make_loader(ShardedFileDataset(folders["uneven"], wconf(1, 3, 2), strategy="oversampling"))
    assert check_resume_everywhere(factory, 2, steps=resume_steps(2, 11)) == 9


@pytest.mark.parametrize("k", [0, 1, 6, 9, 14])
def test_restore_seeks_instead_of_replaying(folders, k):
    """Restoring at position k reads one sample and opens one shard before the next sample,
    whatever k: the cost of a restore does not grow with the position in the epoch."""
    wc = wconf(1, 2, 0)
    ds = ShardedFileDataset(folders[".npy"], wc)
    reference = worker_stream(ShardedFileDataset(folders[".npy"], wc), 0, 2)[0]
    with _ActiveWorker(0, 2):
        ds.reset_state_deep()
        it = iter(ds)
        for _ in range(k):
            next(it)
        state = decode_part(encode_part(plain_dataset_state(ds.save_state())), DatasetState)
        assert state.fields == {"epoch": [2], "position": k}
        fresh = ShardedFileDataset(folders[".npy"], wc)
        fresh.restore_state(state)
        it = iter(fresh)
        first = next(it)
        assert (fresh.samples_read, fresh.shards_opened) == (1, 1)
        rest = [first, *it]
    assert_streams(rest, reference[k:], f"after restore at {k}")


def test_restore_through_the_loader_reads_one_sample(folders, monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    loader = make_loader(ShardedFileDataset(folders[".npy"], wconf(0, 1, 0)))
    it = iter(loader)
    seen = [next(it) for _ in range(22)]
    state = decode(encode(loader.save_state_rank()))
    del it
    ds = ShardedFileDataset(folders[".npy"], wconf(0, 1, 0))
    fresh = make_loader(ds)
    fresh.restore_state_rank(state)
    it = iter(fresh)
    nxt = next(it)
    # in-process, the snapshot before sample 22 is taken when it is asked for: the state
    # is the snapshot after 21 samples plus a skip of 1 (the loader replays that one)
    skip = state.position.workers[0].skip
    assert skip <= 1 and ds.samples_read == 1 + skip
    reference = list(make_loader(ShardedFileDataset(folders[".npy"], wconf(0, 1, 0))))
    assert_streams([*seen, nxt, *it], reference, "resumed epoch")


def test_only_needed_shards_are_opened_one_or_two_at_a_time(folders, monkeypatch):
    opened: list[str] = []
    real = sharded_module.open_reader

    def spy(store, entry, whole, options):
        opened.append(entry.path)
        return real(store, entry, whole, options)

    monkeypatch.setattr(sharded_module, "open_reader", spy)
    ds = ShardedFileDataset(folders[".npy"], wconf(1, 2, 2))
    open_counts = []
    with _ActiveWorker(1, 0):
        ds.reset_state_deep()
        keys = []
        for _ in ds:
            keys.append(ds.sample_key)
            open_counts.append(len(ds._readers))
            ds.restore_sample([0, 0, 0])  # an extra shard for restore_sample
            open_counts.append(len(ds._readers))
    shards = list(dict.fromkeys(k[0] for k in keys))  # the shards this worker's piece touches
    assert len(shards) < len(SIZES)
    assert max(open_counts) <= 2
    iterated = [n for n in opened if n != "shard-00000.npy"]
    assert iterated == [f"shard-{s:05d}.npy" for s in shards if s != 0]


def test_restore_sample_rebuilds_samples_and_their_random_draws(folders):
    wc = wconf(1, 2, 2)
    rebuild = ShardedFileDataset(folders["uneven"], wc, strategy="oversampling")
    rng = random.Random(0)
    for worker, epoch in [(0, 0), (1, 3)]:
        ds = ShardedFileDataset(folders["uneven"], wc, strategy="oversampling")
        seen = []
        with _ActiveWorker(worker, epoch):
            ds.reset_state_deep()
            for s in ds:
                seen.append((ds.sample_key, s, torch.rand(2), np.random.rand()))
        for key, sample, draw, npdraw in rng.sample(seen, 5) + [seen[-1]]:
            with _ActiveWorker(worker, epoch):
                again = rebuild.restore_sample(json.loads(json.dumps(key)))
                assert_same(again, sample, f"key {key}")
                assert torch.equal(torch.rand(2), draw) and np.random.rand() == npdraw


@pytest.mark.parametrize("key", [None, [0, 0], [0, 0, 0, 0], [9, 0, 0], [0, 7, 0], [-1, 0, 0], [0, True, 0], "0"])
def test_bad_restore_keys(folders, key):
    ds = ShardedFileDataset(folders[".npy"], wconf())
    with pytest.raises(RestoreKeyError, match="ShardedFileDataset key"):
        ds.restore_sample(key)


# -- errors -----------------------------------------------------------------------------


def broken_folder(tmp_path: Path, metadata: Any) -> Path:
    write_shards(tmp_path, npy_shards([4, 4]))
    text = metadata if isinstance(metadata, str) else json.dumps(metadata)
    (tmp_path / "metadata.json").write_text(text)
    return tmp_path


def shard(path: str, samples: Any = 4) -> dict[str, Any]:
    return {"path": path, "samples": samples}


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ("{not json", "metadata.json: not valid JSON"),
        ([1, 2], r"metadata.json: Expected `object`, got `array`"),
        ({"shards": []}, "metadata.json: Object missing required field `format`"),
        (
            {"format": 3, "shards": []},
            r"metadata.json: `\$.format` is 3, this version of savable_loader reads formats 1 and 2",
        ),
        ({"format": 1}, "missing required field `shards`"),
        (
            {"format": 1, "shards": [shard("shard-00000.npy", "4")]},
            r"Expected `int`, got `str` - at `\$.shards\[0\].samples`",
        ),
        ({"format": 1, "shards": [shard("shard-00000.npy", -1)]}, r"Expected `int` >= 0 - at `\$.shards\[0\].samples`"),
        ({"format": 1, "shards": [{**shard("shard-00000.npy"), "x": 1}]}, r"unknown field `x` - at `\$.shards\[0\]`"),
        (
            {"format": 1, "shards": [shard("a.txt")]},
            r"`\$.shards\[0\].path` is 'a.txt'; expected a file ending in one of .npy, .pt, .jsonl",
        ),
        (
            {"format": 1, "shards": [shard("/etc/x.npy")]},
            r"`\$.shards\[0\].path` is '/etc/x.npy'; expected a path relative",
        ),
        (
            {"format": 1, "shards": [shard("../x.npy")]},
            r"`\$.shards\[0\].path` is '../x.npy'; expected a path relative",
        ),
        (
            {"format": 1, "shards": [shard("shard-00000.npy"), shard("shard-00000.npy")]},
            r"`\$.shards\[1\].path` is 'shard-00000.npy', which is listed twice",
        ),
        (
            {"format": 1, "shards": [shard("shard-00000.npy"), shard("gone.npy")]},
            r"`\$.shards\[1\].path`: shard file .*gone.npy does not exist",
        ),
    ],
)
def test_bad_metadata(tmp_path, metadata, message):
    folder = broken_folder(tmp_path, metadata)
    with pytest.raises(DataError, match=message) as info:
        ShardedFileDataset(folder, wconf())
    assert str(folder / "metadata.json") in str(info.value)


def test_missing_metadata(tmp_path):
    with pytest.raises(DataError, match=r"metadata.json: cannot read the shard metadata \(No such file"):
        ShardedFileDataset(tmp_path, wconf())


def first_error(folder: Path) -> str:
    ds = ShardedFileDataset(folder, wconf(0, 1, 0), shuffle=False)
    with pytest.raises(DataError) as info:
        list(make_loader(ds))
    return str(info.value)


def _layouts() -> dict[str, list[Any]]:
    """Shards whose rows lie in their files in every way: C and Fortran order, rows of
    one element and of none, views of a shared storage, rows that are not contiguous."""
    base = torch.arange(9 * 6, dtype=torch.int16).reshape(9, 6)
    return {
        ".npy": [
            np.arange(5 * 3 * 2, dtype=np.float64).reshape(5, 3, 2),
            np.asfortranarray(np.arange(4 * 3, dtype=np.int32).reshape(4, 3)),
            np.arange(6, dtype=np.uint16),
            np.zeros((3, 0), np.float32),
            np.array([True, False, True]),
        ],
        ".pt": [
            torch.linspace(0, 1, 4 * 5, dtype=torch.bfloat16).reshape(4, 5),
            {"a": base[:5, 1:], "b": base[:5, 0], "t": base.t()[:5], "s": base[::2]},
            {"x": torch.arange(24, dtype=torch.float32).reshape(4, 6).t()[:4], "y": torch.zeros(4, 0)},
            torch.view_as_complex(torch.arange(3 * 2 * 2, dtype=torch.float32).reshape(3, 2, 2)),
            torch.arange(5) % 2 == 0,
        ],
    }


def _rows_of(shard: Any) -> list[Any]:
    if isinstance(shard, np.ndarray):
        return [torch.from_numpy(np.array(row)) for row in shard]
    if isinstance(shard, torch.Tensor):
        return list(shard)
    return [{k: v[i] for k, v in shard.items()} for i in range(len(next(iter(shard.values()))))]


@pytest.mark.parametrize(("fmt", "located"), [(".npy", True), (".pt", True), (".pt", False)])
def test_every_row_layout_reads_back_exactly(tmp_path, fmt, located, monkeypatch):
    """Rows read with pread (C order, contiguous rows), from memory (Fortran order,
    rows not contiguous in the file) and, for .pt, with the storages' offsets not found
    (the file loaded whole): each the row written, its dtype and shape included."""
    import savable_loader.sources.shards.readers as shard_io

    if not located:
        monkeypatch.setattr(shard_io, "storage_offsets", lambda path, storages: None)
    shards = _layouts()[fmt]
    write_shards(tmp_path, shards, fmt=fmt)
    samples, _ = worker_stream(ShardedFileDataset(tmp_path, wconf(), shuffle=False), 0, 0)
    expected = [row for shard in shards for row in _rows_of(shard)]
    assert len(samples) == len(expected)
    for got, want in zip(samples, expected):
        for g, w in zip(*(list(x.values()) if isinstance(x, dict) else [x] for x in (got, want))):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w), (g, w)
            assert g.is_contiguous() and g.untyped_storage().nbytes() == g.nbytes, "a row owns its own memory"


def test_shard_length_disagrees_with_metadata(tmp_path):
    # (num_workers=0 only: a loader whose worker raised takes ~10 s to shut its workers
    # down, whatever the dataset; the error text crosses the process boundary unchanged)
    write_shards(tmp_path, npy_shards([4, 4]))
    np.save(tmp_path / "shard-00001.npy", npy_shards([4, 3])[1])
    text = first_error(tmp_path)
    assert f"{tmp_path / 'shard-00001.npy'}: the metadata says 4 samples, the shard holds 3" in text


@pytest.mark.parametrize(
    ("fmt", "content", "message"),
    [
        (".npy", b"garbage", "cannot read the .npy shard"),
        (".npy", None, "cannot read the .npy shard"),  # an object array (needs pickle)
        (".pt", b"garbage", "cannot read the .pt shard"),
        (".pt", [torch.zeros(4)], "a .pt shard must hold a tensor or a dict of tensors, got list"),
        (".pt", {"a": torch.zeros(4), "b": torch.zeros(3)}, r"common first dimension, got \{'a': 4, 'b': 3\}"),
        (".pt", {"a": torch.zeros(4), "b": 1}, "entry 'b' is not a tensor"),
        (".jsonl", b'{"a": 1}\n{"a": 2}\n{"a": \n{"a": 4}\n', "line 3 is not valid JSON"),
        (".npy", ">f4", r"dtype >f4 \(>f4\) cannot become a torch.Tensor"),  # another byte order
        (".npy", "<M8[s]", r"dtype <M8\[s\] \(datetime64\[s\]\) cannot become a torch.Tensor"),
    ],
)
def test_unreadable_shards(tmp_path, fmt, content, message):
    write_shards(tmp_path, MAKERS[fmt]([4, 4]), fmt=fmt)
    path = tmp_path / f"shard-00001{fmt}"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        np.save(path, np.zeros(4, dtype=content))
    elif content is None:
        np.save(path, np.array([object()] * 4, dtype=object), allow_pickle=True)
    else:
        torch.save(content, path)
    text = first_error(tmp_path)
    assert text.startswith(f"{path}: ") and re.search(message, text), text


def test_bad_arguments(folders):
    with pytest.raises(LoaderUsageError, match="strategy must be one of"):
        ShardedFileDataset(folders[".npy"], wconf(), strategy="pad")
    with pytest.raises(LoaderUsageError, match="shuffle must be a bool"):
        ShardedFileDataset(folders[".npy"], wconf(), shuffle=1)
    with pytest.raises(LoaderUsageError, match="needs worker_config"):
        ShardedFileDataset(folders[".npy"], None)
    with pytest.raises(DataError, match="fmt is '.csv'"):
        write_shards(folders[".npy"], [], fmt=".csv")


def test_config_names_the_data(folders, tmp_path):
    ds = ShardedFileDataset(folders[".npy"], wconf())
    config = ds.config()
    assert {k: config[k] for k in ("shards", "samples", "strategy", "shuffle")} == {
        "shards": 5,
        "samples": 30,
        "strategy": "exact",
        "shuffle": True,
    }
    write_shards(tmp_path, npy_shards([7, 3, 10, 4, 5]))
    assert ShardedFileDataset(tmp_path, wconf()).config()["metadata"] != config["metadata"]


def test_each_pass_of_a_repeat_is_reshuffled_and_resumes(folders, monkeypatch):
    set_snapshot_policy(monkeypatch, "every")

    def factory():
        return make_loader(sl.wrappers.RepeatDataset(ShardedFileDataset(folders[".npy"], wconf(0, 2, 0)), repeats=2))

    first = [sample_id(s) for s in factory()]
    assert len(first) == 30 and first[:15] != first[15:]
    assert sorted(first[:15]) != sorted(first[15:])  # each pass lays out the whole folder anew
    assert check_resume_everywhere(factory, 1, steps=[0, 7, 14, 15, 16, 29, 30]) == 8


def test_empty_shards_and_an_empty_folder(tmp_path):
    write_shards(tmp_path / "a", npy_shards([0, 5, 0, 3, 0]))
    got = [x for r in epoch_ids(tmp_path / "a", 2, 2, 0) for x in r]
    assert sorted(got) == list(range(8))
    write_shards(tmp_path / "b", npy_shards([0, 0]))
    assert epoch_ids(tmp_path / "b", 2, 2, 0, strategy="oversampling") == [[], []]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_restore_sample(folders, num_workers):
    """Any batch of a 2-epoch run is rebuilt by ``loader.restore_sample`` from its key."""

    def build():
        ds = ShardedFileDataset(folders["uneven"], wconf(1, 2, num_workers), strategy="oversampling")
        return make_loader(sl.wrappers.BatchDataset(sl.wrappers.MapDataset(ds, lambda x: x + torch.rand(3)), 4))

    loader = build()
    seen = [(batch, str(loader.restore_key)) for _ in range(2) for batch in loader]
    assert len(seen) == 8
    other = build()
    for batch, key in random.Random(3).sample(seen, 4) + [seen[-1]]:
        assert_same(other.restore_sample(key), batch, key)


# -- rank layouts and file choice (porting nanochat's loader) ---------------------------


@pytest.fixture(scope="module")
def parquet_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.shard_writers import write_parquet_folder

    folder = write_parquet_folder(tmp_path_factory.mktemp("strided"))  # 4 files, row groups of 2
    sl.sources.index_folder(folder, progress=False)
    return folder


def _row_groups(folder: Path, names: list[str]) -> list[list[int]]:
    """The ids of every row group of the named files, in file order (read with pyarrow)."""
    import pyarrow.parquet as pq

    out = []
    for name in names:
        f = pq.ParquetFile(folder / name)
        out += [f.read_row_group(g, columns=["id"]).column("id").to_pylist() for g in range(f.num_row_groups)]
    return out


def _ids(loader: Any) -> list[int]:
    return [int(row["id"]) for row in loader]


@pytest.mark.parametrize("strategy", ["undersampling", "oversampling"])
def test_strided_rank_layout_deals_row_groups_by_rank(parquet_folder, strategy):
    """nanochat's layout: rank r of W reads row groups r, r + W, r + 2W, ... in file order;
    every rank reads as many rows as the smallest (or the largest, wrapping around)."""
    groups = _row_groups(parquet_folder, [f"part-{i}.parquet" for i in range(4)])
    world = 2
    mine = [[i for g in groups[r::world] for i in g] for r in range(world)]
    length = (max if strategy == "oversampling" else min)(len(m) for m in mine)
    for r in range(world):
        wc = wconf(r, world, 0)
        ds = ShardedFileDataset(parquet_folder, wc, rank_layout="strided", shuffle=False, strategy=strategy)
        want = [mine[r][i % len(mine[r])] for i in range(length)]
        assert _ids(sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)) == want
    contiguous = ShardedFileDataset(parquet_folder, wconf(0, 2, 0), shuffle=False, strategy=strategy)
    assert (
        _ids(sl.SavableDataLoader(contiguous, batch_size=None, worker_config=contiguous.worker_config))
        != mine[0][:length]
    )


def test_strided_rank_layout_shuffled_reads_every_row_once(parquet_folder):
    """Shuffled, every epoch deals other row groups: the ranks' epochs still cover the
    corpus (undersampling drops at most what the largest rank holds beyond the smallest)."""
    for epoch in range(2):
        seen: Counter[int] = Counter()
        for r in range(2):
            wc = wconf(r, 2, 2)
            ds = ShardedFileDataset(parquet_folder, wc, rank_layout="strided", strategy="undersampling")
            loader = sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)
            loader.set_epoch(epoch)
            seen.update(_ids(loader))
        assert max(seen.values()) == 1 and len(seen) >= 18


def test_strided_rank_layout_resumes_exactly(parquet_folder, monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    wc = wconf(1, 2, 2)
    factory = lambda: make_loader(
        ShardedFileDataset(parquet_folder, wc, rank_layout="strided", strategy="oversampling")
    )
    assert check_resume_everywhere(factory, 2, steps=[0, 1, 3, 6, 9, 10, 13]) >= 7


def test_a_state_of_one_rank_layout_is_refused_by_the_other(parquet_folder):
    wc = wconf(0, 2, 0)
    loader = make_loader(ShardedFileDataset(parquet_folder, wc, strategy="undersampling"))
    it = iter(loader)
    next(it)
    state = loader.save_state_rank()
    other = make_loader(ShardedFileDataset(parquet_folder, wc, strategy="undersampling", rank_layout="strided"))
    with pytest.raises(sl.errors.ConfigMismatchError, match="rank_layout"):
        other.restore_state_rank(state)


def test_strided_rank_layout_refusals(parquet_folder):
    with pytest.raises(DataError, match=r"strategy='exact'.*rank 0: \d+, rank 1: \d+"):
        ShardedFileDataset(parquet_folder, wconf(0, 2, 0), rank_layout="strided", shuffle=False)
    with pytest.raises(DataError, match="1 units .* world_size=2"):
        ShardedFileDataset(_one_group_folder(parquet_folder), wconf(0, 2, 0), rank_layout="strided")
    with pytest.raises(LoaderUsageError, match="rank_layout must be one of"):
        ShardedFileDataset(parquet_folder, wconf(), rank_layout="interleaved")


def _one_group_folder(folder: Path) -> Path:
    single = folder.parent / "single"
    if not single.exists():
        write_shards(single, [np.arange(3)])
    return single


def test_files_choose_what_is_read(parquet_folder):
    """``files=slice(None, -1)``: all but the last file (nanochat's validation file is
    its last); globs and lists choose by name; a state is refused under another choice."""
    groups = {
        name: [i for g in _row_groups(parquet_folder, [name]) for i in g]
        for name in [f"part-{i}.parquet" for i in range(4)]
    }

    def ids(files: Any) -> list[int]:
        wc = wconf()
        ds = ShardedFileDataset(parquet_folder, wc, shuffle=False, files=files)
        return _ids(sl.SavableDataLoader(ds, batch_size=None, worker_config=wc))

    train = [i for name in ["part-0.parquet", "part-1.parquet", "part-2.parquet"] for i in groups[name]]
    assert ids(slice(None, -1)) == train
    assert ids(slice(-1, None)) == groups["part-3.parquet"]
    assert ids("part-[13].parquet") == groups["part-1.parquet"] + groups["part-3.parquet"]
    assert ids(["part-2.parquet", "part-0*"]) == groups["part-0.parquet"] + groups["part-2.parquet"]
    with pytest.raises(DataError, match=r"'val-\*' matches none of the 4 files \(part-0.parquet"):
        ids("val-*")
    with pytest.raises(DataError, match="chooses none"):
        ids(slice(4, None))
    with pytest.raises(LoaderUsageError, match="slice"):
        ids(3)
    wc = wconf()
    loader = make_loader(ShardedFileDataset(parquet_folder, wc, files=slice(None, -1)))
    next(iter(loader))
    state = loader.save_state_rank()
    with pytest.raises(sl.errors.ConfigMismatchError, match="files"):
        make_loader(ShardedFileDataset(parquet_folder, wc, files=slice(None, -2))).restore_state_rank(state)


def test_a_folder_with_held_out_files_read_whole_warns(tmp_path):
    """Files named for validation are read only when chosen: reading the whole folder
    warns, naming them; ``files=`` (or a folder of training files only) does not."""
    import warnings

    write_shards(tmp_path, [np.arange(4), np.arange(3)])
    (tmp_path / "shard-00001.npy").rename(tmp_path / "val-00000.npy")
    meta = json.loads((tmp_path / "metadata.json").read_text())
    meta["shards"][1]["path"] = "val-00000.npy"
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match=r"val-00000.npy included, whose name says it is held out"):
        ShardedFileDataset(tmp_path, wconf())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train = ShardedFileDataset(tmp_path, wconf(), files="shard-*")
        assert [s.path for s in train.metadata.shards] == ["shard-00000.npy"]
        ShardedFileDataset(tmp_path, wconf(), files=["val-00000.npy"])
