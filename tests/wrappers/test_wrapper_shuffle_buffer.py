"""ShuffleBufferDataset: a permutation per epoch, reshuffled every epoch, the buffer in the
state, and a restore that never reads the source again."""

from __future__ import annotations

import array
import enum
import struct
from typing import Any

import pytest
import torch

import savable_loader as sl
from savable_loader.dataset.values import from_plain, plain_dataset_state
from savable_loader.errors import LoaderUsageError, StateError
from savable_loader.state import decode, encode, load_file, save_file
from savable_loader.state.codec import decode_part, encode_part
from savable_loader.state.schema import ArrayValue, DatasetState
from savable_loader.wrappers import ShuffleBufferDataset
from tests.common import RangeSource, assert_streams, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES,
    make_loader,
    make_wc,
    resume_steps,
    set_snapshot_policy,
    split_by_worker,
    worker_values,
)

pytestmark = pytest.mark.timeout(120)

N = 20
SIZE = 5


class Colour(enum.IntEnum):
    RED = 1


# Values each in-process ForwardOnlySource produced, per source id (reads, not draws).
READS: dict[str, list[int]] = {}


class ForwardOnlySource(sl.SavableDataset):
    """A stream that can only go forward: no ``__getitem__``, and every value it produces
    is logged under ``log_id`` (in-process loaders only), so a test can see whether a
    restore reads any value twice."""

    _savable_fields = ("pos",)

    def __init__(self, n: int, worker_config: sl.WorkerConfig, log_id: str) -> None:
        super().__init__(worker_config)
        self.n = n
        self.log_id = log_id
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = 0

    def __iter__(self):
        while self.pos < self.n:
            value = self.pos
            self.pos += 1
            READS.setdefault(self.log_id, []).append(value)
            yield value

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


def shuffled_loader(num_workers: int, size: int = SIZE, n: int = N, buffer_state: str = "auto"):
    wc = make_wc(num_workers)
    return make_loader(ShuffleBufferDataset(RangeSource(n, wc), size, buffer_state=buffer_state))


def ids(epoch: list[torch.Tensor]) -> list[int]:
    return [int(x[0]) for x in epoch]


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    steps = resume_steps(num_workers, N)
    assert check_resume_everywhere(lambda: shuffled_loader(num_workers), 2, steps=steps) >= 9


@pytest.mark.parametrize("num_workers", [0, 2])
def test_permutation_per_epoch_reshuffled(num_workers):
    workers = max(num_workers, 1)
    a = epochs_of(shuffled_loader(num_workers), 3)
    orders = [ids(e) for e in a]
    for order in orders:
        # each worker yields a permutation of its share of the source
        for w, mine in enumerate(split_by_worker(order, workers)):
            assert sorted(mine) == worker_values(N, w, workers)
            assert mine != worker_values(N, w, workers)  # not the input order
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]
    b = epochs_of(shuffled_loader(num_workers), 3)
    for e, (x, y) in enumerate(zip(a, b)):
        assert_streams(x, y, f"second run, epoch {e}")


def test_shuffling_is_local_to_the_buffer():
    # the sample at output position i was read at input position <= i + SIZE - 1
    for order in map(ids, epochs_of(shuffled_loader(0), 3)):
        assert all(v <= i + SIZE - 1 for i, v in enumerate(order))
    # a buffer of one keeps the input order
    assert ids(list(shuffled_loader(0, size=1))) == list(range(N))
    # a buffer larger than the data is a full shuffle of it, still a permutation
    order = ids(list(shuffled_loader(0, size=100)))
    assert sorted(order) == list(range(N)) and order != list(range(N))


def _shuffle_node(state: sl.state.RankState, worker: int) -> tuple[DatasetState, int]:
    """The ShuffleBufferDataset node of a worker's state and the number of samples the
    worker had yielded when it was taken."""
    ws = next(w for w in state.position.workers if w.worker_id == worker)
    # every-sample snapshots: a worker process has snapshotted ahead of what the main
    # process yielded; in-process, the snapshot before the next sample is not taken yet
    assert ws.skip <= 1
    node = ws.dataset
    assert isinstance(node, DatasetState)
    assert node.type == "savable_loader.wrappers.shuffle_buffer.ShuffleBufferDataset"
    assert sorted(node.fields) == ["buffer", "draws", "ended", "held", "keys", "seed"]
    assert node.children[0].type == "tests.common.RangeSource"
    return node, ws.snapshot_index


@pytest.mark.parametrize("buffer_state", ["auto", "payload"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_contains_the_buffer(num_workers, buffer_state, monkeypatch):
    """The samples, or with "auto" over a source that can fetch them again, their keys."""
    set_snapshot_policy(monkeypatch, "every")
    workers = max(num_workers, 1)
    loader = shuffled_loader(num_workers, buffer_state=buffer_state)
    it = iter(loader)
    seen = [next(it) for _ in range(3 * workers)]  # 3 from each worker: buffers are full
    state = decode(encode(loader.save_state_rank()))
    for w in range(workers):
        node, yielded_count = _shuffle_node(state, w)
        assert yielded_count >= 2
        buffer = node.fields["buffer"]
        if buffer_state == "auto":
            assert buffer is None and node.fields["held"] == "keys"
            held = list(node.fields["keys"])
            assert len(held) == SIZE - 1
        else:
            assert node.fields["held"] == "payload"
            assert len(buffer) == SIZE - 1 and all(isinstance(x, ArrayValue) for x in buffer)
            held = [int(x[0]) for x in from_plain(buffer)]
            assert node.fields["keys"] == held
        yielded = [int(x[0]) for x in seen if int(x[0]) % workers == w][:yielded_count]
        read = node.children[0].fields["pos"]  # RangeSource's next value for this worker
        # what the worker had read is exactly what it had yielded plus what it holds
        assert sorted(held + yielded) == [v for v in worker_values(N, w, workers) if v < read]
        assert node.fields["draws"] == yielded_count
    del it


def test_state_buffer_drains_at_the_end(monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    loader = shuffled_loader(0, buffer_state="payload")
    it = iter(loader)
    next(it), next(it)
    sizes = {}
    for _ in it:
        node, yielded = _shuffle_node(loader.save_state_rank(), 0)
        sizes[yielded] = len(node.fields["buffer"])
    # full (SIZE - 1 after each pick) while the source lasts, then draining to empty; the
    # snapshot after item j is taken before the item is yielded (items 3..N are saved at)
    assert sizes == {j: min(SIZE - 1, N - j) for j in range(3, N + 1)}


@pytest.mark.parametrize("k", [1, 7, 15, 16, 19])
def test_restore_never_reads_the_source_again(k, monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    wc = make_wc(0)

    def factory(log_id: str):
        return make_loader(ShuffleBufferDataset(ForwardOnlySource(N, wc, log_id), SIZE))

    reference = list(factory("reference"))
    assert sorted(reference) == list(range(N)) and reference != list(range(N))
    loader = factory(f"before-{k}")
    it = iter(loader)
    got = [next(it) for _ in range(k)]
    state = decode(encode(loader.save_state_rank()))
    del it
    fresh = factory(f"after-{k}")
    fresh.restore_state_rank(state)
    assert got + list(fresh) == reference
    # The restored source goes on from where the snapshotted one had read to: the
    # samples in the buffer come from the state, not from reading the source again.
    snapshot = state.position.workers[0].dataset
    pos = 0 if snapshot is None else snapshot.children[0].fields["pos"]
    # snapshot after k samples: the buffer is full (or the source read out)
    assert pos == min(N, k + SIZE - 1)
    assert READS.get(f"after-{k}", []) == list(range(pos, N))


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, "5", None])
def test_bad_size(bad):
    wc = make_wc(0)
    with pytest.raises(LoaderUsageError, match=rf"ShuffleBufferDataset size must be a positive int, got {bad!r}"):
        ShuffleBufferDataset(RangeSource(3, wc), bad)


def test_other_arguments():
    with pytest.raises(LoaderUsageError, match="ShuffleBufferDataset wraps a SavableDataset, got list"):
        ShuffleBufferDataset([1, 2], 2)
    assert ShuffleBufferDataset(RangeSource(3, make_wc(0)), 7).config() == {"size": 7}
    with pytest.raises(LoaderUsageError, match="ShuffleBufferDataset buffer_state must be one of"):
        ShuffleBufferDataset(RangeSource(3, make_wc(0)), 7, buffer_state="positions")


@pytest.mark.parametrize(("num_workers", "policy"), [(0, "every"), (0, "default"), (2, "every")])
def test_resume_from_keys_at_every_step(num_workers, policy, monkeypatch):
    """A state of keys (the source fetches the buffered samples again, their draws from
    their keys) resumes exactly, as one of payload does; and its buffer is the keys alone."""
    set_snapshot_policy(monkeypatch, policy)
    factory = lambda: shuffled_loader(num_workers, n=40)
    steps = None if num_workers == 0 else [0, 3, 20, 40, 43, 80]
    assert check_resume_everywhere(factory, 2, steps=steps) >= 6
    loader = factory()
    it = iter(loader)
    next(it)
    held = [w.dataset.fields["held"] for w in loader.save_state_rank().position.workers if w.dataset is not None]
    assert held and set(held) == {"keys"}
    del it


# -- packed buffers: a stream of ints or floats is held in an array.array ---------------


class ValuesSource(sl.SavableDataset):
    """Savable source of ``values`` as they are (worker w of W takes w, w+W, ...)."""

    _savable_fields = ("pos",)

    def __init__(self, values: list[Any], worker_config: sl.WorkerConfig) -> None:
        super().__init__(worker_config)
        self.values = values
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self):
        while self.pos < len(self.values):
            value = self.values[self.pos]
            self.pos += self.worker_config.workers_per_rank
            yield value

    def config(self) -> dict[str, Any]:
        return {"n": len(self.values)}


NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0]  # a NaN with a payload
STREAMS = {
    "ints": list(range(-12, 12)),
    "ints-widening": [*range(8), 2**31, *range(8, 16), -(2**31) - 1, 2**31 - 1, *range(16, 24)],
    "floats": [0.5 * i for i in range(20)] + [NAN, -0.0, float("inf"), -NAN],
    # a bool, an IntEnum and ints beyond 64 bits turn the packed buffer into a list
    "ints-then-bool": [*range(10), True, *range(10, 20), False],
    "ints-at-the-bounds": [2**63 - 1, -(2**63), 5, 2**63, 7, 2**64 - 1, *range(10)],
    "int-enum": [*range(8), Colour.RED, *range(8, 16)],
    "huge-int": [*range(8), -(2**63) - 1, *range(8, 16)],
    "mixed": [1, 1.0, 2, None, "a", 3, b"b", 4, 2.5, 5, 6, 7, 8.0, 9],
}


def stream_loader(name: str, num_workers: int, size: int = 4) -> sl.SavableDataLoader:
    wc = make_wc(num_workers)
    return make_loader(ShuffleBufferDataset(ValuesSource(STREAMS[name], wc), size))


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_packed_and_mixed_streams_resume_at_every_step(name, monkeypatch):
    # an IntEnum (any int subclass) or an int beyond 64 bits cannot be in a state: the
    # state is refused when a snapshot holds it (in-process: when it is encoded), naming
    # the field; every other stream resumes exactly
    set_snapshot_policy(monkeypatch, "every")
    refused = {"int-enum": "Colour", "huge-int": r"integers in a state must be within"}
    if name in refused:  # (a buffer of the whole stream holds the value when saved)
        with pytest.raises(StateError, match=rf"ShuffleBufferDataset\.buffer\[\d+\].*{refused[name]}"):
            check_resume_everywhere(lambda: stream_loader(name, 0, size=len(STREAMS[name])), 2)
        return
    assert check_resume_everywhere(lambda: stream_loader(name, 0), 2) >= len(STREAMS[name])


@pytest.mark.parametrize("name", ["ints", "ints-widening", "floats", "ints-then-bool", "ints-at-the-bounds"])
def test_packed_streams_resume_with_worker_processes(name, monkeypatch):
    set_snapshot_policy(monkeypatch, "every")
    n = len(STREAMS[name])
    assert check_resume_everywhere(lambda: stream_loader(name, 2), 2, steps=resume_steps(2, n)) >= 7


@pytest.mark.parametrize("name", sorted(set(STREAMS) - {"int-enum"}))
def test_packed_streams_yield_the_same_values_and_types(name):
    values = STREAMS[name]
    got = list(stream_loader(name, 0, size=len(values)))

    # a full shuffle of the stream: the same multiset of (type, bits)
    def bits(v: Any) -> tuple[str, Any]:
        return (type(v).__name__, struct.pack("<d", v) if type(v) is float else v)

    assert sorted(map(bits, got), key=repr) == sorted(map(bits, values), key=repr)


def test_buffer_of_ints_or_floats_is_packed_and_the_state_holds_its_memory():
    wc = make_wc(0)
    ds = ShuffleBufferDataset(ValuesSource(list(range(100)), wc), 10)
    it = iter(ds)
    next(it)
    assert type(ds.buffer) is array.array and ds.buffer.typecode == "i" and len(ds.buffer) == 9
    frozen = ds.save_state()
    held = ds.buffer.tolist()
    next(it), next(it)  # the dataset swaps and pops its live buffer right after the save
    node = decode_part(encode_part(plain_dataset_state(frozen)), DatasetState)
    value = node.fields["buffer"]
    assert isinstance(value, ArrayValue) and (value.library, value.dtype, value.shape) == ("array", "i", (9,))
    for back in (from_plain(frozen.fields["buffer"]), from_plain(value)):
        assert type(back) is array.array and back.tolist() == held
    # floats: typecode "d"; a restored buffer stays packed and yields the same floats
    fl = ShuffleBufferDataset(ValuesSource(STREAMS["floats"], wc), 30)
    assert [struct.pack("<d", v) for v in fl] and type(fl.buffer) is array.array and fl.buffer.typecode == "d"


def test_a_sample_of_another_type_turns_the_buffer_into_a_list():
    wc = make_wc(0)
    ds = ShuffleBufferDataset(ValuesSource([1, 2, 3, True, 4, 2**64], wc), 10)
    it = iter(ds)
    with pytest.raises(StopIteration):
        while True:
            next(it)
    ds.reset_state_deep()
    ds.buffer = array.array("q", [1, 2])
    ds._append(True)
    assert type(ds.buffer) is list and ds.buffer == [1, 2, True] and type(ds.buffer[2]) is bool
    ds.buffer = array.array("q", [1])
    ds._append(2**63)
    assert type(ds.buffer) is list and ds.buffer == [1, 2**63]
    ds.buffer = array.array("i", [1, -5])
    ds._append(-(2**40))  # beyond 32 bits: widened
    assert type(ds.buffer) is array.array and ds.buffer.typecode == "q" and ds.buffer.tolist() == [1, -5, -(2**40)]
    ds.buffer = array.array("i", [1])
    ds._append(2**63)  # beyond 64 bits: a list
    assert type(ds.buffer) is list and ds.buffer == [1, 2**63]
    ds.buffer = []
    ds._append(2**62)
    assert type(ds.buffer) is array.array and ds.buffer.typecode == "q"
    ds.buffer = []
    ds._append(2**63)  # beyond int64 from the start: a list
    assert type(ds.buffer) is list
    ds.buffer = array.array("d", [1.0])
    ds._append(1)  # an int into a float buffer would come back a float: a list
    assert ds.buffer == [1.0, 1] and type(ds.buffer[1]) is int


def test_an_older_state_with_a_list_buffer_restores_exactly():
    # states written before packed buffers hold the buffer as a list: it stays a list
    wc = make_wc(0)
    reference = list(ShuffleBufferDataset(ValuesSource(list(range(30)), wc), 8))
    ds = ShuffleBufferDataset(ValuesSource(list(range(30)), wc), 8)
    it = iter(ds)
    head = [next(it) for _ in range(5)]
    state = ds.save_state()
    state.fields["buffer"] = list(from_plain(state.fields["buffer"]))  # the old form
    fresh = ShuffleBufferDataset(ValuesSource(list(range(30)), wc), 8)
    fresh.restore_state(decode_part(encode_part(plain_dataset_state(state)), DatasetState))
    assert type(fresh.buffer) is list
    assert head + list(fresh) == reference


def test_malformed_packed_bytes_in_a_state_file_name_the_field(tmp_path):
    loader = stream_loader("ints", 0, size=6)
    it = iter(loader)
    next(it), next(it)
    state = loader.save_state_rank()
    buffer = state.position.workers[0].dataset.fields["buffer"]
    assert isinstance(buffer, ArrayValue) and buffer.library == "array"
    path = tmp_path / "s.state"
    save_file(path, state)
    raw = encode(state)
    packed = buffer.data
    assert raw.count(packed) == 1
    where = r"position\.workers\[0\]\.dataset: ShuffleBufferDataset\.buffer"
    n = len(packed) // 4
    assert raw.count(b"\xa1i\x91" + bytes([n])) == 1
    for bad in (
        raw.replace(b"\xa1i\x91" + bytes([n]), b"\xa1i\x91" + bytes([n - 1])),  # 4 bytes too many for the shape
        raw.replace(b"\xa1i\x91", b"\xa1d\x92"),  # a 2-d shape (and floats)
        raw.replace(b"\xa1i\x91", b"\xa1l\x91"),  # a typecode of platform-dependent size
        raw.replace(b"\xa5array", b"\xa5arrax"),  # an unknown library
    ):
        with pytest.raises(StateError, match=where):
            decode(bad)
    # a byte changed inside a file is caught by its digest before anything is decoded
    data = bytearray(path.read_bytes())
    data[data.index(packed) + 3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(StateError, match="digest|checksum"):
        load_file(path)
