"""A thin adapter that runs a bench workload through Megatron-Energon (bench only).

Energon pipelines are built from its own ``SavableDataset`` classes: a source of the
indices ``0..n-1`` split round robin over the workers (as every other contender does),
Energon's ``ShuffleBufferDataset`` when the workload has a buffer, ``MapDataset`` with the
workload's sample function and ``BatchDataset`` with torch's ``default_collate``.
Importing this module fails if megatron-energon is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from megatron.energon import BatchDataset, MapDataset, SavableDataLoader, ShuffleBufferDataset, WorkerConfig
from megatron.energon.flavors.base_dataset import SavableDataset
from torch.utils.data import default_collate

from bench.workloads import Workload

__all__ = ["make_loader"]


class IndexSource(SavableDataset):
    """Energon source of ``0..n-1``, round robin over the workers; restorable by key."""

    _savable_fields = ("pos",)

    def __init__(self, n: int, worker_config: WorkerConfig) -> None:
        super().__init__(worker_config=worker_config)
        self.n = n
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = -1

    def len_worker(self, worker_idx: int | None = None) -> int:
        workers = max(1, self.worker_config.num_workers)
        worker = self.worker_config.rank_worker_id() if worker_idx is None else worker_idx
        return len(range(worker, self.n, workers))

    def worker_has_samples(self) -> bool:
        return self.len_worker() > 0

    def __iter__(self) -> Iterator[Any]:
        workers = max(1, self.worker_config.num_workers)
        if self.pos < 0:
            self.pos = self.worker_config.rank_worker_id()
        while self.pos < self.n:
            value = self.pos
            self.pos += workers
            yield {"value": value, "__restore_key__": ("IndexSource", value)}

    def can_restore_sample(self) -> bool:
        return True

    def restore_sample(self, restore_key: Any) -> Any:
        # Energon's shuffle buffer stores restore keys and fetches its samples again
        return {"value": restore_key[-1], "__restore_key__": tuple(restore_key)}

    def config(self) -> dict[str, Any]:
        return {"type": "IndexSource", "n": self.n}


class _OnValue:
    """The workload's sample function applied to a source sample's value."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __call__(self, sample: dict[str, Any]) -> Any:
        return self.fn(sample["value"])


def make_loader(w: Workload, num_workers: int, seed: int) -> SavableDataLoader:
    """An Energon loader over ``w`` with Energon's default checkpoint policy."""
    wc = WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed_offset=seed)
    ds: SavableDataset = IndexSource(w.n, wc)
    if w.buffer:
        ds = ShuffleBufferDataset(ds, w.buffer, worker_config=wc)
    ds = MapDataset(ds, _OnValue(w.sample), worker_config=wc)
    ds = BatchDataset(ds, w.batch_size, default_collate, worker_config=wc)
    return SavableDataLoader(ds)  # Energon's defaults: a worker checkpoint every 60 s
