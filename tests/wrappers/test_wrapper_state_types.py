"""User values held in wrapper states keep their types through a resume (issue #21).

Finding 2: a sample ``{"f32": np.float32(x), "i32": np.int32(i)}`` held by
``ShuffleBufferDataset`` or ``GroupBatchDataset`` at a save came back as Python
``float`` / ``int``, so the resumed batches collated as ``float64`` / ``int64``. Here every
wrapper that holds user values in its state (shuffle buffer, group buckets, micro-batch
rests, packing remainders) holds samples of every kind a state keeps (NumPy scalars of
many dtypes, 0-d and string arrays, tuples, bf16 tensors), saved at every step, at 0
and 2 workers with slow samples so that snapshots land at every point, and the resumed
stream is compared with the uninterrupted one, types and dtypes included. Values a state
cannot give back identical are refused when the snapshot is taken, naming the field.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import savable_loader as sl
from savable_loader.errors import StateError
from savable_loader.sources import IterableSource, StreamInfo
from savable_loader.wrappers import (
    BatchDataset,
    GroupBatchDataset,
    MicroBatchDataset,
    PackingDataset,
    ShuffleBufferDataset,
)
from tests.common import check_resume_everywhere
from tests.wrapper_common import make_loader, make_wc, resume_steps

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore::savable_loader.sources.ReplayWarning")]

N = 10
DELAY = 0.005


def sample(i: int) -> dict[str, Any]:
    return {
        "f32": np.float32(i + 0.25),
        "i32": np.int32(-i),
        "u8": np.uint8(200 + i),
        "f16": np.float16(i / 3),
        "b": np.bool_(i % 2),
        "c64": np.complex64(complex(i, -1)),
        "u16": np.uint16(i),
        "s": np.str_(f"s{i}"),
        "pair": (i, "x"),
        "zero_d": np.array(i, dtype=np.int16),
        "strings": np.array(["a", "bc"][: 1 + i % 2]),
        "bf16": torch.tensor([i / 7], dtype=torch.bfloat16),
    }


def samples(info: StreamInfo) -> Any:
    for i in info.split(range(N)):
        time.sleep(DELAY)
        yield sample(i)


def samples_from(info: StreamInfo, position: int) -> Any:
    step = info.num_global_workers
    for i in range(info.global_worker + position * step, N, step):
        time.sleep(DELAY)
        yield sample(i)


def tokens(info: StreamInfo) -> Any:
    for i in info.split(range(N)):
        time.sleep(DELAY)
        yield torch.arange(1 + i % 4, dtype=torch.int16) + 100 * i


def keep(item: Any) -> Any:
    return item


def collate_without_strings(batch: list[dict[str, Any]]) -> Any:
    # torch does not collate string arrays
    return torch.utils.data.default_collate([{k: v for k, v in s.items() if k != "strings"} for s in batch])


def columns(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch as lists of NumPy scalars, one array and a tuple of lists (micro-batch rests hold them)."""
    return {
        "f32": [s["f32"] for s in batch],
        "zero_d": np.stack([s["zero_d"] for s in batch]),
        "pair": ([s["i32"] for s in batch], [s["s"] for s in batch]),
        "c64": [s["c64"] for s in batch],
    }


PIPELINES: dict[str, Callable[[sl.SavableDataset], sl.SavableDataset]] = {
    "shuffle": lambda ds: ShuffleBufferDataset(ds, 3),
    "shuffle_collated": lambda ds: BatchDataset(ShuffleBufferDataset(ds, 3), 2, collate_fn=collate_without_strings),
    "group_batch": lambda ds: GroupBatchDataset(
        ds, 2, lambda s: int(s["i32"]) % 3 == 0, collate_fn=collate_without_strings
    ),
    "micro_batch": lambda ds: MicroBatchDataset(BatchDataset(ds, 4, collate_fn=columns), 3),
}


def loader(name: str, num_workers: int, seek: bool = True) -> sl.SavableDataLoader:
    wc = make_wc(num_workers)
    if name == "packing":
        return make_loader(PackingDataset(IterableSource(tokens, wc), 5, bos=-1))
    source = IterableSource(samples, wc, seek=samples_from if seek else None)
    # collate_fn: the loader's per-item conversion would turn NumPy scalars into tensors
    return make_loader(PIPELINES[name](source), collate_fn=keep)


def reported_case(num_workers: int) -> sl.SavableDataLoader:
    """The issue's example: NumPy float32 / int32 scalars through a shuffle buffer, batched
    by ``default_collate`` (slow samples, so that snapshots land at every point)."""

    def values(info: StreamInfo) -> Any:
        for i in info.split(range(8)):
            time.sleep(DELAY)
            yield {"f32": np.float32(i + 0.5), "i32": np.int32(i)}

    wc = make_wc(num_workers)
    return make_loader(BatchDataset(ShuffleBufferDataset(IterableSource(values, wc), 4), 2))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_reported_case_collates_float32_and_int32_after_a_restore(num_workers):
    # the batches after a restore collated as float64 / int64 (from the first one on)
    loader_ = reported_case(num_workers)
    reference = [batch for _ in range(2) for batch in loader_]
    assert reference and all(b["f32"].dtype == torch.float32 and b["i32"].dtype == torch.int32 for b in reference)
    # whole streams against the uninterrupted run (assert_same compares dtypes too)
    assert (
        check_resume_everywhere(lambda: reported_case(num_workers), 2) == len(reference) + 3
    )  # every step and both epoch ends


@pytest.mark.parametrize("name", [*sorted(PIPELINES), "packing"])
def test_held_values_keep_their_types_in_process(name):
    assert check_resume_everywhere(lambda: loader(name, 0), 2) >= 10


@pytest.mark.parametrize("name", ["shuffle", "group_batch", "micro_batch"])
def test_held_values_keep_their_types_with_workers(name):
    steps = resume_steps(2, len(list(loader(name, 0))))
    assert check_resume_everywhere(lambda: loader(name, 2), 2, steps=steps) >= 5


def test_held_values_keep_their_types_without_seek():
    assert check_resume_everywhere(lambda: loader("shuffle", 0, seek=False), 1) >= 10


Point = collections.namedtuple("Point", "x y")


def refused(value: Any, wrap: Callable[[sl.SavableDataset], sl.SavableDataset], num_workers: int = 0) -> str:
    """The error of a loader whose wrapper holds samples carrying ``value``."""
    wc = make_wc(num_workers)
    ds = wrap(IterableSource(lambda info: ({"v": value, "i": i} for i in info.split(range(8))), wc))
    with pytest.raises(StateError) as info:
        list(make_loader(ds))
    return str(info.value)


@pytest.mark.parametrize(
    "value, what",
    [
        (Point(1, 2), "namedtuple"),
        (collections.OrderedDict(a=1), "OrderedDict"),
        (np.longdouble(1.5), "longdouble"),
        (torch.zeros(1, requires_grad=True), "requires grad"),
        (bytearray(b"x"), "bytearray"),
    ],
    ids=lambda v: v if isinstance(v, str) else type(v).__name__,
)
def test_values_a_state_would_change_are_refused_naming_the_field(value, what):
    message = refused(value, lambda ds: ShuffleBufferDataset(ds, 3))
    assert "state field ShuffleBufferDataset.buffer[0]['v']" in message and what in message
    message = refused(value, lambda ds: GroupBatchDataset(ds, 4, lambda s: s["i"] % 2, collate_fn=list))
    assert "state field GroupBatchDataset.buckets[0][1][0]['v']" in message and what in message


def test_refusal_in_a_worker_process_names_the_field():
    message = refused(Point(1, 2), lambda ds: ShuffleBufferDataset(ds, 3), num_workers=2)
    assert "ShuffleBufferDataset.buffer[0]['v']" in message and "namedtuple" in message


def test_micro_batch_rest_refuses_a_namedtuple_batch():
    def batches(ds: sl.SavableDataset) -> sl.SavableDataset:
        batched = BatchDataset(ds, 4, collate_fn=lambda b: Point([s["i"] for s in b], [s["i"] for s in b]))
        return MicroBatchDataset(batched, 2)

    assert "state field MicroBatchDataset.rest" in refused(None, batches)
