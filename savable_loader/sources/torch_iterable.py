"""TorchIterableSource: a plain ``torch.utils.data.IterableDataset`` as a savable source.

``SavableDataLoader(my_iterable_dataset, batch_size=32, num_workers=4)`` builds one of
these and runs it on the savable-pipeline path (snapshots attached to items, see
``pipeline/worker.py``). What torch does, it does:

* each worker iterates its own copy of the dataset, which shards itself by
  ``torch.utils.data.get_worker_info()``; after a restore, physical worker ``p`` plays
  logical worker ``(p + rotation) % num_workers``, so ``get_worker_info()`` reports the
  *logical* id (and ``.dataset``: the copy being iterated; ``.seed``: a seed of the
  logical worker and the epoch, below 2**63). ``worker_init_fn`` gets the logical id too.
  Without workers ``get_worker_info()`` is None, as in torch;
* with ``batch_size`` a worker collects that many items into a list, which the loader's
  ``collate_fn`` (``default_collate``) turns into a batch; its last batch may be short,
  or dropped with ``drop_last`` (torch's ``_IterableDatasetFetcher``). With
  ``batch_size=None`` every item is one pipeline item (``default_convert``);
* ``len(loader)`` is torch's, from ``len(dataset)``, with torch's warning when an epoch
  yields more than that (``pipeline/iterable.py``);
* an exception the dataset raises for a batch counts as that batch: the loader raises
  it and goes on with the next batch if called again, as torch does.

The state of one worker is ``position`` (batches produced this epoch), ``items`` (items
taken from the dataset's iterator) and ``user_state``:

* a dataset with ``state_dict()`` / ``load_state_dict()`` (torchdata's ``Stateful``
  protocol; Hugging Face ``datasets.IterableDataset`` has it) is snapshotted with its
  ``state_dict()`` (converted to plain values exactly, see ``_user_state.py``). A restore
  iterates a fresh copy (``copy.deepcopy``) into which that state was loaded: no replay
  from the epoch's start. Epochs after the restored one iterate the dataset object
  itself again, as the run being resumed did;
* any other dataset resumes by iterating again and discarding the first ``position``
  batches. The loader warns (:class:`ReplayWarning`) with the count per worker.

Random draws are exact: before the dataset's ``__iter__`` and before each batch the
source re-seeds Python ``random``, NumPy's and torch's global RNGs from ``(seed, rank,
logical worker, epoch, batch)`` (``savable_loader.rng.seeding.item_seed``: below ``2**63``),
during a replay as in the run being resumed.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    IterableDataset,
    IterDataPipe,
    get_worker_info,
    graph_settings,
)

from savable_loader._torch.internals import replace_worker_info
from savable_loader.config import WorkerConfig, active_global_rngs, active_repetitions
from savable_loader.dataset.base import SavableDataset, type_name
from savable_loader.errors import DataError, LoaderUsageError, StateError
from savable_loader.rng.formulas import datapipe_shuffle_seed, torch_iterable_base, torch_worker_info_seed
from savable_loader.rng.seeding import counter_seed, global_seeder, item_seed
from savable_loader.sources._user_state import from_state_tree, to_state_tree
from savable_loader.sources.iterable import ReplayWarning
from savable_loader.state.schema import DatasetState, PipelinePosition

__all__ = ["TorchIterableSource", "is_stateful", "iterable_sources", "torch_worker_seed", "warn_replays"]

#: How to resume an IterableDataset the loader cannot checkpoint: said in every error.
WAY_OUT = (
    "implement state_dict()/load_state_dict() returning plain values (torchdata's Stateful protocol), "
    "or use savable_loader.sources.IterableSource (a generator function with an explicit position)"
)


def is_stateful(dataset: Any) -> bool:
    """True if ``dataset`` has callable ``state_dict`` and ``load_state_dict`` (torchdata's
    ``Stateful`` protocol).

    Example::

        is_stateful(datasets.Dataset.from_dict({"x": [1]}).to_iterable_dataset())   # True
    """
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def _name(dataset: Any) -> str:
    return type(dataset).__qualname__


def torch_worker_seed(worker_config: WorkerConfig, worker: int, epoch: int) -> int:
    """``get_worker_info().seed`` of logical ``worker`` in ``epoch``: below 2**63, as torch's."""
    wc = worker_config
    return torch_worker_info_seed(wc.seed, int(wc.rank or 0), worker, epoch, active_repetitions())


class TorchIterableSource(SavableDataset):
    """A savable source over a plain ``torch.utils.data.IterableDataset`` (see the module
    docstring for what resumes how).

    The loader builds it for you: ``SavableDataLoader(iterable_dataset, batch_size=32,
    num_workers=2)``. Build it yourself to put such a dataset into a savable pipeline
    (``batch_size=None``: one pipeline item per dataset item). Example::

        wc = WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
        hf = datasets.Dataset.from_dict({"x": list(range(100))}).to_iterable_dataset(num_shards=4)
        pipeline = BatchDataset(TorchIterableSource(hf, wc), 8)
        loader = SavableDataLoader(pipeline, batch_size=None, worker_config=wc)
    """

    _savable_fields = ("position", "items", "user_state")

    def __init__(
        self,
        dataset: IterableDataset,
        worker_config: WorkerConfig,
        *,
        batch_size: int | None = None,
        drop_last: bool = False,
    ) -> None:
        super().__init__(worker_config)
        if not isinstance(dataset, IterableDataset) or isinstance(dataset, SavableDataset):
            raise LoaderUsageError(
                f"TorchIterableSource needs a torch IterableDataset that is not a SavableDataset, got {_name(dataset)}"
            )
        if batch_size is not None and (type(batch_size) is not int or batch_size < 1):
            raise LoaderUsageError(f"batch_size should be a positive integer value, but got batch_size={batch_size!r}")
        if batch_size is None and drop_last:
            raise LoaderUsageError(
                "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = bool(drop_last)
        self._shufflers = buffer_shufflers(dataset)
        #: True: resumed from the dataset's ``state_dict()``; False: by replay (a dataset
        #: without one, or one whose own restore is known to be inexact: a Hugging Face
        #: shuffle buffer, replayed from the epoch's start under the same seed instead)
        self.stateful = is_stateful(dataset) and not self._shufflers
        self._live: Any = None  # the dataset object being iterated (a restored copy or `dataset`)
        if self.stateful:
            self._check_state_dict()
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.position = 0
        self.items = 0
        self.user_state: dict[str, Any] | None = None
        self._live = None

    def _capture(self, target: Any) -> dict[str, Any]:
        what = f"{_name(target)}.state_dict()"
        try:
            tree = to_state_tree(target.state_dict(), what)
        except StateError as e:
            raise StateError(f"{e}. To resume this dataset: {WAY_OUT}") from None
        return {"state_dict": tree}

    def _check_state_dict(self) -> None:
        """Refuse at construction a ``state_dict()`` that a state could not hold (one that
        fails before any iteration is left to fail at the first snapshot, if at all)."""
        try:
            state = self.dataset.state_dict()  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - may need an iteration first; checked at snapshots
            return
        try:
            to_state_tree(state, f"{_name(self.dataset)}.state_dict()")
        except StateError as e:
            raise StateError(f"{e}. To resume this dataset: {WAY_OUT}") from None

    # -- iteration --------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        return _Iteration(self)

    def save_state(self) -> DatasetState:
        if self.stateful and self._live is not None:
            self.user_state = self._capture(self._live)
        return super().save_state()

    # -- the rest of the SavableDataset contract --------------------------------------

    def config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "dataset": type_name(self.dataset),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "resume": "state_dict" if self.stateful else "replay",
        }
        if self._shufflers:
            config["shuffle_buffers"] = _shuffler_fingerprint(self._shufflers)
        return config

    def restore_sample_blocker(self) -> str | None:
        return (
            f"{_name(self.dataset)} is a torch IterableDataset: it cannot build one batch alone (no random access); "
            "restore keys need a map-style dataset, or savable_loader.sources.IterableSource with seek="
        )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_live"] = None  # an iteration does not travel to worker processes
        return state


def buffer_shufflers(dataset: Any) -> list[Any]:
    """The shuffle buffers of a Hugging Face ``IterableDataset``
    (``.shuffle(buffer_size=...)``), whose ``load_state_dict`` refills the buffer with new
    examples rather than restoring it (as the ``datasets`` documentation says): such a
    dataset is resumed by replay, not from its ``state_dict()``."""
    if not type(dataset).__module__.startswith("datasets."):
        return []
    found, pending, seen = [], [getattr(dataset, "_ex_iterable", None)], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            found.append(node)
        pending.append(getattr(node, "ex_iterable", None))
        pending.extend(getattr(node, "ex_iterables", None) or [])
    return found


def _shuffler_fingerprint(nodes: list[Any]) -> list[str]:
    """Each buffer's size and a hash of its generator's seed state: a replay is exact only
    under the same shuffle seed (``.shuffle(buffer_size=...)`` without ``seed=`` draws
    one at random), so a restore under another is refused by the configuration check."""
    out = []
    for node in nodes:
        generator = getattr(node, "generator", None)
        state = getattr(getattr(generator, "bit_generator", None), "state", None)
        digest = hashlib.blake2b(repr(state).encode(), digest_size=8).hexdigest()
        out.append(f"buffer_size={getattr(node, 'buffer_size', None)} seed_state={digest}")
    return out


def _prepare_datapipe(pipe: IterDataPipe, wc: WorkerConfig, worker: int, epoch: int) -> None:
    """What torch's DataLoader does to an ``IterDataPipe`` before iterating it: shard it
    (``sharding_filter``) over ranks and workers, and seed its shufflers with a seed
    shared by every worker and rank. torch draws that seed from the loader's generator
    (torch's global RNG by default) at each ``iter()``; here it derives from the loader's
    seed and the epoch, so that a resume shuffles alike."""
    rank, world_size = int(wc.rank or 0), int(wc.world_size or 1)  # set by WorkerConfig.__post_init__
    if wc.num_workers:
        total, index = wc.num_workers * world_size, worker * world_size + rank
    else:
        total, index = world_size, rank
    graph_settings.apply_sharding(pipe, total, index)
    shared = torch.Generator().manual_seed(datapipe_shuffle_seed(wc.seed, epoch, active_repetitions()))
    graph_settings.apply_random_seed(pipe, shared)


def _copy(dataset: Any) -> Any:
    """A copy to load a restored state into, so that the dataset object itself (iterated
    again in later epochs without workers or with persistent workers) never sees it: a
    deep copy, or a shallow one if the dataset holds what cannot be deep-copied (a
    multiprocessing Value, a lock, an open connection)."""
    try:
        return copy.deepcopy(dataset)
    except Exception:  # noqa: BLE001 - deepcopy raises whatever a member's __reduce__ raises
        return copy.copy(dataset)


class _Iteration:
    """One epoch of one worker: the dataset's iterator, batched as torch's fetcher does."""

    def __init__(self, source: TorchIterableSource) -> None:
        self.source = source
        wc = source.worker_config
        worker, epoch = wc.rank_worker_id(), wc.active_epoch()
        self.base = torch_iterable_base(wc.seed, int(wc.rank or 0), worker, epoch, active_repetitions())
        self.ended = False
        target = source.dataset
        restored = source.user_state
        if restored is not None:  # a Stateful dataset's snapshot: load it into a fresh copy
            target = _copy(target)
            target.load_state_dict(from_state_tree(restored["state_dict"]))
        source._live = target
        if get_worker_info() is not None:
            replace_worker_info(id=worker, dataset=target, seed=torch_worker_seed(wc, worker, epoch))
        if isinstance(target, IterDataPipe):
            _prepare_datapipe(target, wc, worker, epoch)
        #: the seeder of the global RNGs the loader's global_rngs= lists
        self.seed_all = global_seeder(active_global_rngs())
        self.seed_all(item_seed(self.base))  # __iter__'s draws are the same on a resume
        self.iterator = iter(target)
        if restored is None and source.position:
            self._replay(source.position, source.items)

    def __iter__(self) -> _Iteration:
        return self

    def __next__(self) -> Any:
        """The next batch (a list of ``batch_size`` items) or item; the counters advance
        also when the dataset raises (the failed batch counts as consumed, as in torch)."""
        src = self.source
        if self.ended:
            raise StopIteration
        self.seed_all(item_seed(counter_seed(self.base, src.position)))
        size = src.batch_size
        if size is None:
            try:
                item = next(self.iterator)
            except StopIteration:
                self.ended = True
                raise
            except Exception:
                src.position += 1
                raise
            src.position += 1
            src.items += 1
            return item
        batch: list[Any] = []
        try:
            while len(batch) < size:
                try:
                    batch.append(next(self.iterator))
                except StopIteration:
                    self.ended = True
                    break
        except Exception:
            src.position += 1
            src.items += len(batch)
            raise
        src.items += len(batch)
        if not batch or (src.drop_last and len(batch) < size):
            raise StopIteration
        src.position += 1
        return batch

    def _replay(self, batches: int, items: int) -> None:
        """Produce and discard the first ``batches`` batches again (a dataset without
        ``state_dict``), with the RNG seeds of the run being resumed."""
        src = self.source
        src.position = src.items = 0
        while src.position < batches:
            try:
                next(self)
            except StopIteration:
                raise DataError(
                    f"{_name(src.dataset)}: worker {src.worker_config.rank_worker_id()}'s iterator ended after "
                    f"{src.position} batches ({src.items} items) while replaying to the saved position of {batches} "
                    f"batches ({items} items): the dataset yields less than when the state was saved"
                ) from None
            except Exception:  # noqa: BLE001, S112 - a batch that failed in the run being resumed fails again
                continue
        if src.items != items:
            raise DataError(
                f"{_name(src.dataset)}: worker {src.worker_config.rank_worker_id()} replayed {batches} batches of "
                f"{src.items} items, the saved position had {items} items: the dataset changed since the state was saved"
            )


def warn_replays(pipeline: SavableDataset, position: PipelinePosition) -> None:
    """Warn (:class:`ReplayWarning`, in the main process) when restoring ``position``
    makes a :class:`TorchIterableSource` of ``pipeline`` without ``state_dict`` replay
    items, with the count per worker."""
    replaying = [s for s in iterable_sources(pipeline) if not s.stateful]
    if not replaying:
        return
    node_type = type_name(replaying[0])
    counts = []
    for ws in sorted(position.workers, key=lambda w: w.worker_id):
        if ws.exhausted or ws.index == 0:
            continue
        nodes = _nodes(ws.dataset, node_type) if ws.dataset is not None else []
        items = sum(int(n.fields.get("items") or 0) for n in nodes)
        if pipeline is replaying[0]:  # the skip offset counts this source's batches
            items += ws.skip * (replaying[0].batch_size or 1)
            counts.append(f"worker {ws.worker_id}: {items} items")
        else:
            more = f" and {ws.skip} pipeline items" if ws.skip else ""
            counts.append(f"worker {ws.worker_id}: {items} items{more}")
    if not counts:
        return
    names = " / ".join(sorted({_name(s.dataset) for s in replaying}))
    rank, how = pipeline.worker_config.rank, "by iterating it again"
    if any(s._shufflers for s in replaying):
        what = (
            f"{names} shuffles with a buffer (.shuffle(buffer_size=...)), which its load_state_dict() does not "
            "restore (it refills the buffer with other examples)"
        )
        how = "exactly, by iterating it again from the epoch's start under the same shuffle seed"
        way_out = (
            "shuffle the map-style datasets.Dataset instead (SavableDataLoader(ds, shuffle=True), or "
            "ds.shuffle(seed=...) before to_iterable_dataset())"
        )
    else:
        what, way_out = f"{names} is a torch IterableDataset without state_dict()/load_state_dict()", WAY_OUT
    warnings.warn(
        ReplayWarning(
            f"{what}: rank {rank} resumes epoch {position.epoch} {how} and discarding the items its workers had "
            f"produced ({'; '.join(counts)}), which costs as long as producing them did. To restore without "
            f"replay: {way_out}"
        ),
        stacklevel=6,  # the restore_state_rank(...) call (through IterableMode.check, Mode.restore, Iterations.restore)
    )


def iterable_sources(dataset: SavableDataset) -> list[TorchIterableSource]:
    """The :class:`TorchIterableSource` nodes of the pipeline ``dataset``."""
    found = [dataset] if isinstance(dataset, TorchIterableSource) else []
    for child in dataset.children():
        found += iterable_sources(child)
    return found


def _nodes(state: DatasetState, type_: str) -> list[DatasetState]:
    found = [state] if state.type == type_ else []
    for child in state.children:
        found += _nodes(child, type_)
    return found
