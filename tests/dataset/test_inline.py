"""savable_loader/dataset/inline.py: a pipeline worker's small tensors ride inside its message."""

from __future__ import annotations

import collections
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import savable_loader as sl
from savable_loader.dataset.inline import (
    INLINE_MAX_BYTES,
    _Inline,
    collate_for_inline,
    inline_default_collate,
    inline_small_tensors,
)
from savable_loader.wrappers import BatchDataset

Pair = collections.namedtuple("Pair", "tokens label")


def through_a_queue(value: Any) -> Any:
    """What the main process unpickles of what a worker's result queue pickles."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(value)
    return pickle.loads(buf.getvalue())


def test_small_tensors_come_back_equal_in_dtype_shape_and_values() -> None:
    tensors = [
        torch.arange(12, dtype=torch.int64).reshape(3, 4),
        torch.rand(2, 3, 5),
        torch.tensor([True, False]),
        torch.zeros(0, 4),
        torch.tensor(3.5, dtype=torch.float16),
        torch.arange(6, dtype=torch.uint8),
        torch.randn(3, dtype=torch.complex64),
        *(torch.arange(4, dtype=d) for d in (torch.int8, torch.int16, torch.int32, torch.float64)),
        *(torch.arange(4).to(getattr(torch, n)) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)),
    ]
    out = inline_small_tensors(tensors)
    assert all(isinstance(v, _Inline) for v in out[:2])
    back = through_a_queue(out)
    for a, b in zip(tensors, back):
        assert type(b) is torch.Tensor and b.dtype == a.dtype and b.shape == a.shape
        assert b.stride() == a.stride() and torch.equal(a, b)


def test_containers_keep_their_types_and_a_tensor_seen_twice_stays_one_object() -> None:
    t = torch.arange(5)
    payload = {"a": [t, t], "b": (torch.ones(2),), "c": Pair(torch.zeros(3), "x"), "d": "text", "e": 7}
    back = through_a_queue(inline_small_tensors(payload))
    assert set(back) == set(payload) and back["d"] == "text" and back["e"] == 7
    assert type(back["a"]) is list and type(back["b"]) is tuple and type(back["c"]) is Pair
    assert back["a"][0] is back["a"][1] and torch.equal(back["a"][0], t)
    assert back["c"].label == "x" and torch.equal(back["c"].tokens, torch.zeros(3))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.zeros(INLINE_MAX_BYTES // 4 + 1), id="larger than the limit"),
        pytest.param(lambda: torch.arange(20)[5:10], id="a view of a larger storage"),
        pytest.param(lambda: torch.arange(12).reshape(3, 4).t(), id="not contiguous"),
        pytest.param(lambda: torch.ones(3, requires_grad=True), id="requires grad"),
        pytest.param(lambda: torch.ones(3, dtype=torch.bfloat16), id="a dtype NumPy lacks"),
        pytest.param(lambda: torch.ones(3, dtype=torch.complex64).conj(), id="a conjugate view"),
        pytest.param(lambda: torch.nn.Parameter(torch.ones(3), requires_grad=False), id="a subclass"),
        pytest.param(lambda: torch.ones(3).to_sparse(), id="sparse"),
    ],
)
def test_tensors_that_could_come_back_different_travel_as_torch_sends_them(make: Any) -> None:
    t = make()
    assert inline_small_tensors([t])[0] is t


def test_two_tensors_on_one_storage_keep_sharing_it() -> None:
    base = torch.arange(6)
    alias = base.view(2, 3)
    out = inline_small_tensors([base, alias])
    assert out[0] is base and out[1] is alias


def test_a_payload_without_small_tensors_is_returned_as_is() -> None:
    payload = {"x": [1, 2], "y": "z"}
    assert inline_small_tensors(payload) is payload
    deep: Any = torch.ones(2)
    for _ in range(20):  # nesting deeper than looked into
        deep = [deep]
    assert inline_small_tensors(deep) is deep


class Tokens(sl.SavableDataset):
    """Rows of int64 tokens of several lengths, and a dict beside them."""

    _savable_fields = ("pos",)

    def __init__(self, n: int, wc: sl.WorkerConfig) -> None:
        super().__init__(wc)
        self.n = n
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self) -> Any:
        while self.pos < self.n:
            i = self.pos
            self.pos += self.worker_config.workers_per_rank
            yield {"tokens": torch.arange(i, i + 40 + i % 9), "id": i, "w": torch.full((2, 2), float(i))}

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


def _collate(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tokens": [it["tokens"] for it in items],
        "id": [it["id"] for it in items],
        "w": torch.stack([it["w"] for it in items]),
    }


def _batches(num_workers: int) -> list[Any]:
    wc = sl.WorkerConfig(num_workers=num_workers, seed=0)
    loader = sl.SavableDataLoader(
        BatchDataset(Tokens(64, wc), batch_size=4, collate_fn=_collate), batch_size=None, worker_config=wc
    )
    return list(loader)


def _samples(num_workers: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for batch in _batches(num_workers):
        assert all(type(x) is torch.Tensor for x in batch["tokens"]) and type(batch["w"]) is torch.Tensor
        for k, i in enumerate(batch["id"]):
            out[i] = (batch["tokens"][k], batch["w"][k])
    return out


@pytest.mark.timeout(120)
def test_samples_from_worker_processes_equal_those_made_in_process() -> None:
    inside, outside = _samples(0), _samples(2)
    assert sorted(inside) == sorted(outside) == list(range(64))
    for i, (tokens, w) in outside.items():
        assert tokens.dtype == inside[i][0].dtype and torch.equal(tokens, inside[i][0])
        assert w.dtype == inside[i][1].dtype and torch.equal(w, inside[i][1])


_Pair = collections.namedtuple("_Pair", "a b")


def _collate_cases() -> list[list[Any]]:
    big = INLINE_MAX_BYTES // 4 // 4 + 1  # four float32 rows of it: just over the inline limit
    return [
        [torch.arange(6, dtype=torch.int64).reshape(2, 3) + i for i in range(4)],
        [torch.full((big,), float(i)) for i in range(4)],  # over the limit: torch's rule
        [torch.ones(3, dtype=torch.bfloat16) * i for i in range(3)],  # NumPy lacks it: torch's rule
        [np.arange(4, dtype=np.float32) * i for i in range(3)],
        [{"x": torch.tensor([i, i + 1]), "n": i, "f": i / 2, "s": f"t{i}"} for i in range(3)],
        [(torch.tensor(float(i)), [torch.tensor([i])]) for i in range(3)],
        [_Pair(torch.zeros(2) + i, i) for i in range(3)],
        [torch.zeros(0, 2) for _ in range(2)],
    ]


def _assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("case", range(len(_collate_cases())))
def test_inline_default_collate_gives_what_default_collate_gives(case: int) -> None:
    batch = _collate_cases()[case]
    _assert_same(inline_default_collate(batch), default_collate(batch))


def test_mismatched_tensors_are_torchs_error() -> None:
    batch = [torch.zeros(2), torch.zeros(3)]
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        default_collate(batch)
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        inline_default_collate(batch)


class _Where(torch.utils.data.Dataset):
    """Collates in a worker process and says where each batch's tensors landed."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> dict[str, bool]:
        cases = _collate_cases()
        return {
            "small_ours": inline_default_collate(cases[0]).is_shared(),
            "small_torch": default_collate(cases[0]).is_shared(),
            "big_ours": inline_default_collate(cases[1]).is_shared(),
            "bfloat16_ours": inline_default_collate(cases[2]).is_shared(),
        }


@pytest.mark.timeout(120)
def test_in_a_worker_a_small_batch_is_stacked_in_ordinary_memory_and_others_in_shared() -> None:
    loader = torch.utils.data.DataLoader(_Where(), batch_size=None, num_workers=1, multiprocessing_context="fork")
    where = next(iter(loader))
    assert where == {"small_ours": False, "small_torch": True, "big_ours": True, "bfloat16_ours": True}


def test_batching_wrappers_collate_small_batches_inline_and_keep_default_collate_in_their_config() -> None:
    wc = sl.WorkerConfig(num_workers=0, seed=0)
    ds = BatchDataset(Rows(8, wc), 4)
    assert ds.collate_fn is default_collate and ds.config()["collate_fn"] is default_collate
    assert collate_for_inline(ds.collate_fn) is inline_default_collate
    mine = lambda batch: batch
    assert collate_for_inline(mine) is mine


class Rows(Tokens):
    """Rows of one length (default_collate stacks them) and their ids."""

    def __iter__(self) -> Any:
        for sample in super().__iter__():
            yield {"x": sample["tokens"][:40], "id": sample["id"]}


@pytest.mark.timeout(120)
def test_batches_collated_by_default_in_workers_equal_those_made_in_process() -> None:
    def batches(num_workers: int) -> dict[int, torch.Tensor]:
        wc = sl.WorkerConfig(num_workers=num_workers, seed=0)
        loader = sl.SavableDataLoader(BatchDataset(Rows(64, wc), 4), batch_size=None, worker_config=wc)
        out = {}
        for batch in loader:
            assert type(batch["x"]) is torch.Tensor and batch["x"].shape == (4, 40)
            for k, i in enumerate(batch["id"].tolist()):
                out[i] = batch["x"][k]
        return out

    inside, outside = batches(0), batches(2)
    assert sorted(inside) == sorted(outside) == list(range(64))
    for i, row in outside.items():
        assert row.dtype == inside[i].dtype and torch.equal(row, inside[i])
