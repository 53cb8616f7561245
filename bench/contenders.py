"""The loaders under test, behind one small interface (thin adapters, bench only).

Each contender builds a fresh loader for a workload and, if it can checkpoint, saves a
state, measures its size and restores it into a fresh loader. Plain torch DataLoaders
are the baselines: ``torch-map`` (map-style, ``shuffle=True``) for the drop-in loaders
and ``torch-iter`` (an ``IterableDataset`` that shards, batches and collates in the
worker) for the pipeline loaders.

Optional contenders (the ``bench`` extra): torchdata's ``StatefulDataLoader`` and
Megatron-Energon's ``SavableDataLoader``. A contender whose package is missing or fails
to import is skipped with the reason printed.
"""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

import savable_loader as sl
from bench.workloads import Workload
from savable_loader.wrappers import BatchDataset, MapDataset, ShuffleBufferDataset

__all__ = ["CONTENDERS", "Contender", "available_contenders"]

SEED = 0


class Contender:
    """One loader: ``make`` a fresh one; ``save`` / ``size`` / ``restore`` if it can."""

    name = ""
    label = ""
    baseline: str | None = None  # name of the plain torch loader its ratios are against
    styles: tuple[str, ...] = ("map",)
    savable = True

    def available(self) -> str | None:
        """None, or why this contender cannot run here."""
        return None

    def applies(self, w: Workload) -> bool:
        """Whether this contender tells something on workload ``w`` (default: always)."""
        return True

    def make(self, w: Workload, num_workers: int) -> Any:
        raise NotImplementedError

    def save(self, loader: Any) -> Any:
        raise NotImplementedError

    def encode(self, state: Any) -> bytes:
        """The state as it would be written to a checkpoint."""
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    def restore(self, loader: Any, data: bytes) -> None:
        raise NotImplementedError


# -- plain torch ----------------------------------------------------------------------


class TorchIterable(IterableDataset):
    """Plain-torch pipeline: shard round robin by worker, (shuffle buffer,) map, batch."""

    def __init__(self, w: Workload) -> None:
        self.n, self.fn, self.batch_size, self.buffer = w.n, w.sample, w.batch_size, w.buffer

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        values: Iterator[int] = iter(range(worker, self.n, workers))
        if self.buffer:
            values = _shuffled(values, self.buffer, random.Random(SEED * 1000 + worker))
        batch: list[Any] = []
        for value in values:
            batch.append(self.fn(value))
            if len(batch) == self.batch_size:
                yield default_collate(batch)
                batch = []
        if batch:
            yield default_collate(batch)


def _shuffled(values: Iterator[int], size: int, rng: random.Random) -> Iterator[int]:
    buffer: list[int] = []
    for v in values:
        buffer.append(v)
        if len(buffer) >= size:
            i = rng.randrange(len(buffer))
            buffer[i], buffer[-1] = buffer[-1], buffer[i]
            yield buffer.pop()
    while buffer:
        i = rng.randrange(len(buffer))
        buffer[i], buffer[-1] = buffer[-1], buffer[i]
        yield buffer.pop()


class TorchMap(Contender):
    name, label, savable = "torch-map", "torch DataLoader (map-style)", False

    def make(self, w: Workload, num_workers: int) -> Any:
        return DataLoader(w.map_dataset(), batch_size=w.batch_size, shuffle=True, num_workers=num_workers)


class TorchIter(Contender):
    name, label, savable, styles = "torch-iter", "torch DataLoader (IterableDataset)", False, ("map", "stream")

    def make(self, w: Workload, num_workers: int) -> Any:
        return DataLoader(TorchIterable(w), batch_size=None, num_workers=num_workers)


# -- savable_loader -------------------------------------------------------------------


class IndexSource(sl.SavableDataset):
    """Savable source of ``0..n-1``, round robin over the workers (as TorchIterable)."""

    _savable_fields = ("pos",)

    def __init__(self, n: int, worker_config: sl.WorkerConfig) -> None:
        super().__init__(worker_config)
        self.n = n
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self) -> Iterator[int]:
        step = self.worker_config.workers_per_rank
        while self.pos < self.n:
            value = self.pos
            self.pos += step
            yield value

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


def savable_pipeline(w: Workload, num_workers: int, buffer: int | None = None) -> sl.SavableDataset:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=num_workers, seed=SEED)
    ds: sl.SavableDataset = IndexSource(w.n, wc)
    size = w.buffer if buffer is None else buffer
    if size:
        ds = ShuffleBufferDataset(ds, size=size)
    return BatchDataset(MapDataset(ds, w.sample), w.batch_size)


class _Savable(Contender):
    def save(self, loader: Any) -> Any:
        return loader.save_state_rank()

    def encode(self, state: Any) -> bytes:
        return sl.state.encode(state)

    def restore(self, loader: Any, data: bytes) -> None:
        loader.restore_state_rank(sl.state.decode(data))


class SavableDropIn(_Savable):
    name, label, baseline = "savable", "SavableDataLoader (drop-in)", "torch-map"

    def make(self, w: Workload, num_workers: int) -> Any:
        return sl.SavableDataLoader(
            w.map_dataset(), batch_size=w.batch_size, shuffle=True, seed=SEED, num_workers=num_workers
        )


class SavableDropInPerBatch(SavableDropIn):
    name, label = "savable-batch", 'SavableDataLoader (drop-in, reseed="batch")'

    def make(self, w: Workload, num_workers: int) -> Any:
        return sl.SavableDataLoader(
            w.map_dataset(), batch_size=w.batch_size, shuffle=True, seed=SEED, num_workers=num_workers, reseed="batch"
        )


class SavableDropInDeclared(SavableDropIn):
    """The drop-in loader told which global RNGs the workload draws from (``global_rngs=``):
    on the ``-torch`` workloads only torch's is re-seeded, elsewhere it is the default."""

    name, label = "savable-declared", "SavableDataLoader (drop-in, global_rngs= the workload's)"

    def applies(self, w: Workload) -> bool:
        return set(w.rngs) != {"numpy", "random", "torch"}  # else it is the default loader

    def make(self, w: Workload, num_workers: int) -> Any:
        return sl.SavableDataLoader(
            w.map_dataset(),
            batch_size=w.batch_size,
            shuffle=True,
            seed=SEED,
            num_workers=num_workers,
            global_rngs=w.rngs,
        )


class SavablePipeline(_Savable):
    name, label, baseline, styles = "savable-pipe", "SavableDataLoader (pipeline)", "torch-iter", ("map", "stream")

    def make(self, w: Workload, num_workers: int) -> Any:
        ds = savable_pipeline(w, num_workers)
        return sl.SavableDataLoader(ds, batch_size=None, worker_config=ds.worker_config)


# -- torchdata ------------------------------------------------------------------------


class StatefulIterable(TorchIterable):
    """TorchIterable with torchdata's Stateful protocol: position, buffer and buffer RNG
    (a user would save those; the global RNGs drawn in ``fn`` are not part of it)."""

    def __init__(self, w: Workload) -> None:
        super().__init__(w)
        self._state: dict[str, Any] | None = None
        self._live: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        live = self._live
        if live is None:
            return {}
        return {"pos": live["pos"], "buffer": list(live["buffer"]), "rng": live["rng"].getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state = state or None

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        rng = random.Random(SEED * 1000 + worker)
        live: dict[str, Any] = {"pos": worker, "buffer": [], "rng": rng}
        if self._state:
            live["pos"], live["buffer"] = self._state["pos"], list(self._state["buffer"])
            rng.setstate(self._state["rng"])
            self._state = None
        self._live = live
        buffer = live["buffer"]
        batch: list[Any] = []

        def pick() -> int:
            i = rng.randrange(len(buffer))
            buffer[i], buffer[-1] = buffer[-1], buffer[i]
            return buffer.pop()

        while live["pos"] < self.n or buffer:
            if live["pos"] < self.n:
                value = live["pos"]
                live["pos"] += workers
                if self.buffer:
                    buffer.append(value)
                    if len(buffer) < self.buffer:
                        continue
                    value = pick()
            else:
                value = pick()
            batch.append(self.fn(value))
            if len(batch) == self.batch_size:
                out, batch = default_collate(batch), []
                yield out
        if batch:
            yield default_collate(batch)


class _TorchData(Contender):
    def available(self) -> str | None:
        try:
            from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means: skip
            return f"torchdata not importable ({type(e).__name__}: {e}); pip install '.[bench]'"
        return None

    def save(self, loader: Any) -> Any:
        return loader.state_dict()

    def restore(self, loader: Any, data: bytes) -> None:
        loader.load_state_dict(pickle.loads(data))


class TorchDataMap(_TorchData):
    name, label, baseline = "torchdata", "torchdata StatefulDataLoader (map-style)", "torch-map"

    def make(self, w: Workload, num_workers: int) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(
            w.map_dataset(),
            batch_size=w.batch_size,
            shuffle=True,
            num_workers=num_workers,
            generator=torch.Generator().manual_seed(SEED),
        )


class TorchDataIter(_TorchData):
    name, label, baseline, styles = (
        "torchdata-iter",
        "torchdata StatefulDataLoader (IterableDataset)",
        "torch-iter",
        ("map", "stream"),
    )

    def make(self, w: Workload, num_workers: int) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(
            StatefulIterable(w), batch_size=None, num_workers=num_workers, generator=torch.Generator().manual_seed(SEED)
        )


# -- Megatron-Energon -----------------------------------------------------------------


class Energon(Contender):
    name, label, baseline, styles = "energon", "Megatron-Energon SavableDataLoader", "torch-iter", ("map", "stream")

    def available(self) -> str | None:
        try:
            from bench import energon_adapter  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means: skip
            return f"megatron-energon not importable ({type(e).__name__}: {e}); pip install '.[bench]'"
        return None

    def make(self, w: Workload, num_workers: int) -> Any:
        from bench import energon_adapter

        return energon_adapter.make_loader(w, num_workers, SEED)

    def save(self, loader: Any) -> Any:
        return loader.save_state_rank()

    def restore(self, loader: Any, data: bytes) -> None:
        loader.restore_state_rank(pickle.loads(data))


CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (
        TorchMap(),
        SavableDropIn(),
        SavableDropInPerBatch(),
        SavableDropInDeclared(),
        TorchDataMap(),
        TorchIter(),
        SavablePipeline(),
        TorchDataIter(),
        Energon(),
    )
}


def available_contenders(names: list[str] | None) -> tuple[list[Contender], dict[str, str]]:
    """The contenders to run (baselines included) and the skipped ones with reasons."""
    chosen = [CONTENDERS[n] for n in (names or list(CONTENDERS))]
    for c in list(chosen):
        if c.baseline and CONTENDERS[c.baseline] not in chosen:
            chosen.append(CONTENDERS[c.baseline])
    skipped = {}
    for c in list(chosen):
        reason = c.available()
        if reason is not None:
            skipped[c.name] = reason
            chosen.remove(c)
    return chosen, skipped
