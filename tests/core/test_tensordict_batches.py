"""TensorDict batches (#23 item 3): ``MicroBatchDataset`` splits any tensordict collection
(TensorDict, nested, lazy stacks, non-tensor data, tensorclasses) and jagged nested
tensors along the batch dimension, exactly; ``BatchDataset``'s default collate stacks
TensorDict samples as torch's ``default_collate`` does; TensorDicts pass through worker
processes (fork, spawn), states (a micro-batch rest) and ``restore_sample``; the drop-in
loader gives what torch's ``DataLoader`` gives, bit for bit; importing savable_loader
never imports tensordict.

Without tensordict these tests skip (``pip install tensordict -c constraints.txt``, the
test extra); under CI (``CI=true``) they fail instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

try:
    import tensordict as td
    from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDict, tensorclass
except ImportError:
    _message = "tensordict is not installed: pip install tensordict -c constraints.txt (the test extra)"
    if os.environ.get("CI"):
        pytest.fail(f"{_message} (CI installs the test extra)", pytrace=False)
    pytest.skip(_message, allow_module_level=True)

import savable_loader as sl
from savable_loader.core.tensordict import TAG, decode_rest, encode_rest
from savable_loader.errors import LoaderUsageError, ResumeMismatchError, StateError
from savable_loader.state import decode, encode
from savable_loader.wrappers import BatchDataset, MapDataset, MicroBatchDataset
from tests.common import RangeSource, assert_same, assert_streams, check_resume_everywhere, epochs_of
from tests.wrapper_common import (
    RESUME_CASES_FAST,
    check_restore_samples,
    make_loader,
    make_wc,
    resume_steps,
    set_snapshot_policy,
)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
N = 17


def sample(x: torch.Tensor) -> TensorDict:
    """A TensorDict sample (batch_size []) of a RangeSource value: a tensor with the
    source's random draws, a random float drawn here, a nested TensorDict with a string."""
    i = int(x[0])
    return TensorDict(
        {"x": x, "noise": torch.rand(2), "meta": {"id": torch.tensor(i, dtype=torch.int32), "name": f"s{i}"}},
        batch_size=[],
    )


def ragged_sample(x: torch.Tensor) -> TensorDict:
    """A sample whose ``tokens`` length varies (1 to 4): stacked lazily."""
    i = int(x[0])
    return TensorDict({"tokens": torch.arange(i % 4 + 1) + 100 * i, "x": x}, batch_size=[])


def jagged_collate(samples: list[TensorDict]) -> TensorDict:
    """A batch whose ``tokens`` is one jagged nested tensor (the layout models take)."""
    tokens = torch.nested.nested_tensor([s["tokens"] for s in samples], layout=torch.jagged)
    return TensorDict({"tokens": tokens, "x": torch.stack([s["x"] for s in samples])}, batch_size=[len(samples)])


def pipeline(num_workers: int, build=sample, batch_size: int = 5, micro: int = 2, collate=None) -> MicroBatchDataset:
    wc = make_wc(num_workers)
    batches = BatchDataset(MapDataset(RangeSource(N, wc), build), batch_size, collate_fn=collate)
    return MicroBatchDataset(batches, micro)


def one_batch(batch, micro: int, batch_size: int | None = None) -> list:
    """The micro-batches of ``batch`` (given by a one-sample source), in-process."""
    ds = MicroBatchDataset(MapDataset(RangeSource(1, make_wc(0)), lambda _: batch), micro, batch_size=batch_size)
    return list(ds)


def rich_batch() -> TensorDict:
    """A batch of 5 with every kind of value: dense tensors of several dtypes, a nested
    TensorDict with dim names, a jagged nested tensor, a NonTensorStack and a
    NonTensorData, a second batch dim."""
    tokens = torch.nested.nested_tensor(
        [torch.arange(n, dtype=torch.int64) + 10 * n for n in (3, 1, 4, 2, 5)], layout=torch.jagged
    )
    return TensorDict(
        {
            "obs": torch.arange(30, dtype=torch.float16).reshape(5, 3, 2),
            "nested": TensorDict(
                {"mask": torch.tensor([True, False, True, True, False]), "deep": {"v": torch.arange(5.0)}},
                batch_size=[5],
            ),
            "tokens": tokens,
            "prompt": NonTensorStack(*[f"p{i}" for i in range(5)]),
            "task": NonTensorData("math", batch_size=[5]),
        },
        batch_size=[5],
    )


# -- splitting ----------------------------------------------------------------------------


def test_a_tensordict_is_split_exactly_along_dim_0():
    batch = rich_batch()
    parts = one_batch(batch, 2, batch_size=5)
    assert [p.batch_size for p in parts] == [torch.Size([2]), torch.Size([2]), torch.Size([1])]
    rows = batch["tokens"].unbind()
    for i, part in enumerate(parts):
        a, b = 2 * i, min(2 * i + 2, 5)
        assert type(part) is TensorDict and list(part.keys()) == list(batch.keys())
        assert_same(part["obs"], batch["obs"][a:b], f"obs {i}")
        assert_same(part.get("nested"), batch.get("nested")[a:b], f"nested {i}")
        assert [r.tolist() for r in part["tokens"].unbind()] == [r.tolist() for r in rows[a:b]]
        assert part["tokens"].dtype == torch.int64 and part["tokens"].layout == torch.jagged
        assert part.get("prompt").tolist() == [f"p{j}" for j in range(a, b)]
        assert part.get("task").data == "math" and part.get("task").batch_size == torch.Size([b - a])
    # the micro-batches put together are the batch
    assert_same(torch.cat([p["obs"] for p in parts]), batch["obs"], "obs")
    # deterministic: the same split twice
    for x, y in zip(parts, one_batch(batch, 2, batch_size=5)):
        assert_same(x, y)


def test_split_matches_tensordicts_own_indexing_without_jagged_leaves():
    batch = rich_batch()
    del batch["tokens"]
    for part, (a, b) in zip(one_batch(batch, 3, batch_size=5), [(0, 3), (3, 5)]):
        assert_same(part, batch[a:b])


def test_lazy_stacks_keep_their_members():
    samples = [ragged_sample(torch.tensor([i, 0, 0, 0])) for i in range(5)]
    batch = default_collate(samples)
    assert type(batch) is LazyStackedTensorDict
    parts = one_batch(batch, 2)
    assert [type(p) for p in parts] == [LazyStackedTensorDict] * 3
    for i, part in enumerate(parts):
        assert part.stack_dim == 0
        assert [m["tokens"].tolist() for m in part.tensordicts] == [
            s["tokens"].tolist() for s in samples[2 * i : 2 * i + 2]
        ]


def test_a_tensorclass_is_split_by_its_own_indexing():
    @tensorclass
    class Pair:
        a: torch.Tensor
        b: torch.Tensor

    batch = Pair(a=torch.arange(4), b=torch.arange(8).reshape(4, 2), batch_size=[4])
    parts = one_batch(batch, 2, batch_size=4)
    assert [type(p) for p in parts] == [Pair, Pair]
    assert_same(parts[1].b, torch.tensor([[4, 5], [6, 7]]))


def test_tensordicts_inside_plain_structures():
    batch = {"td": TensorDict({"a": torch.arange(4)}, batch_size=[4]), "ids": torch.arange(4) * 2, "label": "k"}
    parts = one_batch(batch, 3)
    assert [p["td"]["a"].tolist() for p in parts] == [[0, 1, 2], [3]]
    assert [p["ids"].tolist() for p in parts] == [[0, 2, 4], [6]]
    assert [p["label"] for p in parts] == ["k", "k"]


# -- hostile inputs -------------------------------------------------------------------------


def test_a_tensordict_without_batch_dim_is_a_clear_error():
    with pytest.raises(
        LoaderUsageError, match=r"batch\['td'\] is a TensorDict with batch_size \[\] \(no batch dimension"
    ):
        one_batch({"td": TensorDict({"a": torch.arange(4)}, batch_size=[])}, 2)
    with pytest.raises(LoaderUsageError, match=r"MicroBatchDataset: batch is a TensorDict with batch_size \[\]"):
        one_batch(TensorDict({"a": torch.arange(4)}), 2)


def test_mismatched_batch_dims_are_a_clear_error():
    bad = {"td": TensorDict({"a": torch.zeros(4)}, batch_size=[4]), "b": torch.zeros(3)}
    with pytest.raises(LoaderUsageError, match=r"differ in batch size: \{\"batch\['td'\]\": 4, \"batch\['b'\]\": 3\}"):
        one_batch(bad, 2)
    with pytest.raises(RuntimeError):  # tensordict itself refuses a leaf that does not fit batch_size
        TensorDict({"a": torch.zeros(3)}, batch_size=[4])


def test_micro_larger_than_the_batch_and_empty_batches():
    with pytest.raises(LoaderUsageError, match=r"micro_batch_size=8 is larger than a batch of 4 samples"):
        one_batch(TensorDict({"a": torch.arange(4)}, batch_size=[4]), 8)
    with pytest.raises(LoaderUsageError, match=r"micro_batch_size=8 is larger than the batch size 5"):
        pipeline(0, micro=8)
    # an empty batch yields no micro-batch (as an empty tensor batch does)
    assert one_batch(TensorDict({"a": torch.zeros(0, 3)}, batch_size=[0]), 2) == []
    with pytest.raises(LoaderUsageError, match="ragged along dim 2"):
        nt = torch.nested.nested_tensor([torch.zeros(2, 3), torch.zeros(2, 5)], layout=torch.jagged)
        one_batch(TensorDict({"t": nt}, batch_size=[2]), 1)  # rows of 2 x (3 or 5)


def test_a_tensorclass_rest_is_refused_when_the_state_is_taken():
    @tensorclass
    class Pair:
        a: torch.Tensor

    ds = MicroBatchDataset(MapDataset(RangeSource(1, make_wc(0)), lambda _: Pair(a=torch.arange(4), batch_size=[4])), 2)
    it = iter(ds)
    next(it)
    with pytest.raises(
        StateError, match=r"MicroBatchDataset.rest holds a .*Pair, which a state cannot give back identical"
    ):
        ds.save_state()


def test_malformed_tagged_rests_are_state_errors():
    for bad in (
        {TAG: ["tensordict/9", ["leaf", 1]]},
        {TAG: ["tensordict/1", ["nope", 1]]},
        {TAG: ["tensordict/1", ["td", [2], "cuda", None, ["a"], [["leaf", torch.zeros(2)]]]]},
        {TAG: ["tensordict/1", ["td", [2], None, None, ["a", "b"], [["leaf", torch.zeros(2)]]]]},
        {TAG: ["tensordict/1", ["td", [3], None, None, ["a"], [["leaf", torch.zeros(2)]]]]},
        {TAG: ["tensordict/1", ["jagged", torch.zeros(3), torch.tensor([0, 5])]]},
        {TAG: ["tensordict/1", ["jagged", torch.zeros(3), torch.tensor([1, 3])]]},
        {TAG: ["tensordict/1", ["lazy", False, 0, [["leaf", 3]]]]},
        {TAG: ["tensordict/1", ["leaf", 1]], "other": 2},
    ):
        with pytest.raises(StateError):
            decode_rest(bad)
    # a plain dict that looks like a tagged one goes through the tagged form and comes back
    plain = {TAG: ["tensordict/1", ["leaf", 1]]}
    assert decode_rest(encode_rest(plain, "rest")) == plain


def test_a_tagged_rest_survives_encoding():
    batch = rich_batch()
    back = decode_rest(encode_rest(batch, "rest"))
    assert_same(back, batch)
    with pytest.raises(ResumeMismatchError, match=r"item\['obs'\]: tensors differ"):
        other = batch.clone()
        other["obs"][0, 0, 0] = 99
        assert_same(other, batch)


# -- collate ------------------------------------------------------------------------------


def test_batch_dataset_stacks_tensordicts_as_default_collate_does():
    wc = make_wc(0)
    got = list(BatchDataset(MapDataset(RangeSource(6, wc), sample), 4))
    assert [type(b) for b in got] == [TensorDict, TensorDict]
    assert [b.batch_size for b in got] == [torch.Size([4]), torch.Size([2])]
    first = [sample(x) for x in MapDataset(RangeSource(4, make_wc(0)), lambda x: x)]
    assert got[0]["x"][:, 0].tolist() == [0, 1, 2, 3]
    assert_same(got[0].get("meta").get("id"), torch.stack([s["meta", "id"] for s in first]))
    # the same as torch.stack and as torch's default_collate
    samples = [
        TensorDict({"a": torch.arange(3) + i, "n": {"b": torch.tensor(float(i))}}, batch_size=[]) for i in range(4)
    ]
    assert_same(default_collate(samples), torch.stack(samples))
    # samples of different shapes: a lazy stack (what torch's default_collate gives with tensordict)
    ragged = list(BatchDataset(MapDataset(RangeSource(6, wc), ragged_sample), 3))
    assert [type(b) for b in ragged] == [LazyStackedTensorDict] * 2
    assert_same(ragged[0], default_collate(list(MapDataset(RangeSource(6, wc), ragged_sample))[:3]))


# -- through the loader: resume, workers, restore_sample --------------------------------------


@pytest.mark.parametrize(("num_workers", "policy"), RESUME_CASES_FAST)
def test_resume_at_every_step(num_workers, policy, monkeypatch):
    set_snapshot_policy(monkeypatch, policy)
    factory = lambda: make_loader(pipeline(num_workers))
    items = list(factory())
    assert {type(x) for x in items} == {TensorDict} and len(items) == 10
    assert check_resume_everywhere(factory, 2, steps=resume_steps(num_workers, len(items))) >= 7


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_with_jagged_and_lazy_batches(num_workers):
    for build, collate in ((ragged_sample, jagged_collate), (ragged_sample, None)):
        factory = lambda: make_loader(pipeline(num_workers, build, batch_size=5, micro=2, collate=collate))
        items = list(factory())
        assert {type(x) for x in items} == ({TensorDict} if collate else {LazyStackedTensorDict})
        assert check_resume_everywhere(factory, 2, steps=resume_steps(num_workers, len(items))) >= 7


def test_fork_and_spawn_workers_give_the_same_stream_and_resume():
    reference = epochs_of(make_loader(pipeline(2, ragged_sample, collate=jagged_collate)), 1)
    for context in ("fork", "spawn"):
        loader = make_loader(pipeline(2, ragged_sample, collate=jagged_collate), multiprocessing_context=context)
        got = []
        for item in loader:
            got.append(item)
            if len(got) == 3:
                state = loader.save_state_rank()
        assert_streams(got, reference[0], f"{context} workers")
        resumed = make_loader(pipeline(2, ragged_sample, collate=jagged_collate), multiprocessing_context=context)
        resumed.restore_state_rank(decode(encode(state)))
        assert_streams(list(resumed), reference[0][3:], f"{context} workers after a restore")


def test_restore_sample():
    assert check_restore_samples(lambda: pipeline(0), epochs=2) == 8
    assert check_restore_samples(lambda: pipeline(0, ragged_sample, collate=jagged_collate), epochs=1) == 8
    loader = make_loader(pipeline(2, ragged_sample, collate=jagged_collate))
    run = [(loader.restore_key, item) for item in loader]
    fresh = make_loader(pipeline(2, ragged_sample, collate=jagged_collate))
    for key, item in run[::3]:
        assert_same(fresh.restore_sample(sl.state.RestoreKey.parse(str(key))), item, str(key))


def test_a_pipeline_may_yield_tensordicts_unbatched():
    """With ``batch_size=None`` torch's ``default_convert`` would iterate a batched
    TensorDict as a mapping (and fail); the loader passes it as it is."""
    wc = make_wc(0)
    make = lambda x: {"td": TensorDict({"x": x.repeat(3, 1)}, batch_size=[3]), "i": int(x[0])}
    items = list(make_loader(MapDataset(RangeSource(3, wc), make)))
    assert [type(x["td"]) for x in items] == [TensorDict] * 3 and [x["i"] for x in items] == [0, 1, 2]


# -- the drop-in path against torch's DataLoader ----------------------------------------------


class TensorDictMap:
    """Map-style: sample ``i`` is a TensorDict (lengths vary with ``ragged``)."""

    def __init__(self, n: int, ragged: bool = False) -> None:
        self.n = n
        self.ragged = ragged

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> TensorDict:
        length = i % 3 + 1 if self.ragged else 2
        return TensorDict(
            {"x": torch.arange(length) + i, "meta": {"i": torch.tensor(i), "tag": f"t{i}"}}, batch_size=[]
        )


@pytest.mark.parametrize("ragged", [False, True])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_drop_in_gives_what_torch_gives(num_workers, ragged):
    data = TensorDictMap(10, ragged)
    kw = dict(batch_size=4, num_workers=num_workers)
    if num_workers:
        kw["multiprocessing_context"] = "fork"
    want = list(DataLoader(data, **kw))
    got = list(sl.SavableDataLoader(data, **kw))
    assert [type(b) for b in got] == [LazyStackedTensorDict if ragged else TensorDict] * 3
    assert_streams(got, want, "drop-in vs torch's DataLoader")


def test_drop_in_resumes_and_restores_samples():
    factory = lambda: sl.SavableDataLoader(TensorDictMap(10, ragged=True), batch_size=4, shuffle=True, seed=1)
    assert check_resume_everywhere(factory, 2) >= 7
    loader = factory()
    run = [(loader.restore_key, b) for b in loader]
    for key, batch in run:
        assert_same(factory().restore_sample(key), batch, str(key))


# -- tensordict stays optional -----------------------------------------------------------------


def test_savable_loader_imports_tensordict_only_when_a_batch_is_one():
    code = (
        "import sys, torch, savable_loader as sl\n"
        "from savable_loader.wrappers import BatchDataset, MicroBatchDataset\n"
        "from tests.common import RangeSource\n"
        "wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)\n"
        "ds = MicroBatchDataset(BatchDataset(RangeSource(9, wc), 4), 2)\n"
        "loader = sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)\n"
        "n = 0\n"
        "for item in loader:\n"
        "    n += 1\n"
        "    if n == 2: state = loader.save_state_rank()\n"
        "print(n, 'tensordict' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["5", "False"]  # micro-batches 2, 2, 2, 2, 1
    assert td.__version__  # the module under test here


def test_assert_same_tells_tensordicts_apart():
    batch = rich_batch()
    assert_same(batch, rich_batch())
    changes = {
        "tokens": lambda b: b.set("tokens", torch.nested.nested_tensor([torch.arange(3)] * 5, layout=torch.jagged)),
        "task": lambda b: b.set("task", NonTensorData("code", batch_size=[5])),
        "prompt": lambda b: b.set("prompt", NonTensorStack(*[f"q{i}" for i in range(5)])),
        "deep": lambda b: b.set(("nested", "deep", "v"), torch.arange(5.0) + 1),
        "dtype": lambda b: b.set("obs", b["obs"].float()),
        "order": lambda b: TensorDict({k: b.get(k) for k in reversed(list(b.keys()))}, batch_size=[5]),
        "names": lambda b: b.refine_names("batch"),
    }
    for name, change in changes.items():
        with pytest.raises(ResumeMismatchError, match=f"^{name}"):
            assert_same(change(rich_batch()), batch, name)
        with pytest.raises(ResumeMismatchError, match=f"^{name}"):
            assert_same(batch, change(rich_batch()), name)
    stacked = default_collate([ragged_sample(torch.tensor([i, 0, 0, 0])) for i in range(3)])
    with pytest.raises(ResumeMismatchError, match=r"batch_size torch.Size\(\[3\]\) vs torch.Size\(\[2\]\)"):
        assert_same(stacked, stacked[:2])


def test_a_rest_on_another_device_is_refused_when_the_state_is_taken():
    """A state holds CPU collections only (a restore could not put one back on its
    device): refused by name when saved, not when restored."""
    batch = TensorDict({"a": torch.zeros(4, 2, device="meta")}, batch_size=[4], device="meta")
    with pytest.raises(StateError, match=r"state field rest holds a TensorDict on device meta"):
        encode_rest(batch, "rest")
