"""The savable-pipeline variant of the framework scripts' data: no ``len()``.

The same samples as ``_common.Augmented``, read from a per-epoch permutation that every
global worker takes its share of, augmented by ``MapDataset``, batched inside the
pipeline: ``STEPS_PER_EPOCH`` batches per rank and epoch.
"""

from __future__ import annotations

import _common as c
import torch

import savable_loader as sl
from savable_loader.sources import IterableSource, StreamInfo
from savable_loader.wrappers import BatchDataset, MapDataset


class _Order:
    """This worker's indices of the epoch's permutation (picklable for worker processes)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, info: StreamInfo, position: int = 0) -> list[int]:
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(info.epoch)).tolist()
        return order[info.global_worker :: info.num_global_workers][position:]


def pipeline_loader(world_size: int) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(num_workers=c.WORKERS, seed=0)
    data = c.Augmented(c.dataset_len(world_size))
    order = _Order(len(data))
    ds = BatchDataset(MapDataset(IterableSource(order, wc, seek=order), data.__getitem__), c.BATCH)
    return sl.SavableDataLoader(ds, batch_size=None, worker_config=wc)
