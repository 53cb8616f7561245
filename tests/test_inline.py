"""savable_loader/_inline.py: a pipeline worker's small tensors ride inside its message."""

from __future__ import annotations

import collections
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch

import savable_loader as sl
from savable_loader._inline import INLINE_MAX_BYTES, _Inline, inline_small_tensors
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
