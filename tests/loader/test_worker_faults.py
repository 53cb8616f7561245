"""Fault injection in workers: every fault is a prompt error naming the worker, never a
hang or a wrong stream; a new loader restored from the last saved state continues exactly.

Kinds (both the drop-in path and savable pipelines, 2 fork workers):

* ``kill``: SIGKILL a random worker after a random number of steps;
* ``raise_iter``: the dataset raises while loading a random sample (``__iter__`` of a
  pipeline source, ``__getitem__`` of a map-style dataset);
* ``raise_map``: the map function raises (``MapDataset``'s function, the drop-in
  ``collate_fn``);
* ``stuck``: loading a random sample sleeps forever, with ``timeout=`` set;
* ``unpicklable``: a random sample holds a lock, which cannot cross the process boundary.

Each trial iterates, saving every few steps; the fault must raise the expected error
within ``DEADLINE`` seconds. A dead or stuck worker, and any fault of a savable pipeline,
end the iteration: saving the failed loader must refuse, and a new loader restored from
the last saved state must yield the uninterrupted reference from that point on. A
dataset or collate error on the drop-in path is one batch's, as in torch: that batch
counts as consumed, saving works, and both the iterator and a loader restored from a
state saved right after the error go on with the next batch. ``OUTCOMES`` counts the trials per kind (printed with ``-s``).
"""

from __future__ import annotations

import collections
import gc
import os
import random
import signal
import threading
import time
from typing import Any

import pytest
import torch
from torch.utils.data import default_convert

import savable_loader as sl
from savable_loader.errors import LoaderUsageError, WorkerDiedError, WorkerTimeoutError
from savable_loader.state import decode, encode
from savable_loader.wrappers import MapDataset
from tests.common import RangeSource, assert_streams

pytestmark = pytest.mark.timeout(240)

N = 48
WORKERS = 2
STUCK_TIMEOUT = 1.5
DEADLINE = 20.0  # seconds from the fault to the error; anything longer counts as a hang
TRIALS = {"kill": 4, "raise_iter": 3, "raise_map": 3, "stuck": 1, "unpicklable": 3}
#: Faults of one batch: on the drop-in path the iteration goes on after them (as torch's).
PER_BATCH = ("raise_iter", "raise_map", "unpicklable")
OUTCOMES: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)


class InjectedError(Exception):
    """The exception the faulty datasets raise."""


def _fault(kind: str | None, at: int | None, value: int, where: str) -> None:
    if kind != where or value != at:
        return
    if kind in ("raise_iter", "raise_map"):
        raise InjectedError(f"injected {kind} at sample {value}")
    if kind == "stuck":
        time.sleep(3600)


class _Unpicklable:
    def __init__(self, value: Any) -> None:
        self.value = value
        self.lock = threading.Lock()


class FaultySource(RangeSource):
    """RangeSource that raises or gets stuck at sample ``at`` (``kind``)."""

    def __init__(self, n: int, worker_config: sl.WorkerConfig, kind: str | None = None, at: int | None = None) -> None:
        super().__init__(n, worker_config)
        self.kind, self.at = kind, at

    def __iter__(self):
        for x in super().__iter__():
            _fault(self.kind, self.at, int(x[0]), "raise_iter")
            _fault(self.kind, self.at, int(x[0]), "stuck")
            yield x


class FaultyFn:
    """The map function: ``x * 3 + noise``, raising or unpicklable at sample ``at``."""

    def __init__(self, kind: str | None, at: int | None) -> None:
        self.kind, self.at = kind, at

    def __call__(self, x: Any) -> Any:
        value = int(x[0])
        _fault(self.kind, self.at, value, "raise_map")
        out = x * 3 + int(torch.randint(0, 7, ()))
        if self.kind == "unpicklable" and value == self.at:
            return _Unpicklable(out)
        return out


class FaultyMap:
    """Map-style dataset of noisy tensors, raising or stuck at index ``at``."""

    def __init__(self, n: int, kind: str | None = None, at: int | None = None) -> None:
        self.n, self.kind, self.at = n, kind, at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        _fault(self.kind, self.at, i, "raise_iter")
        _fault(self.kind, self.at, i, "stuck")
        return torch.tensor([i, random.randint(0, 10**6), int(torch.randint(0, 10**6, ()))])


def pipeline_loader(kind: str | None = None, at: int | None = None) -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=WORKERS, seed=5)
    ds = MapDataset(FaultySource(N, wc, kind, at), FaultyFn(kind, at))
    return sl.SavableDataLoader(
        ds,
        batch_size=None,
        worker_config=wc,
        multiprocessing_context="fork",
        timeout=STUCK_TIMEOUT if kind == "stuck" else 0,
    )


def dropin_loader(kind: str | None = None, at: int | None = None) -> sl.SavableDataLoader:
    fn = FaultyFn(kind, at)
    return sl.SavableDataLoader(
        FaultyMap(N, kind, at),
        batch_size=None,
        shuffle=True,
        seed=5,
        num_workers=WORKERS,
        collate_fn=lambda x: fn(default_convert(x)),
        multiprocessing_context="fork",
        timeout=STUCK_TIMEOUT if kind == "stuck" else 0,
    )


FACTORIES = {"pipeline": pipeline_loader, "dropin": dropin_loader}


def _owner(path: str, loader: sl.SavableDataLoader, value: int) -> int:
    """The worker that loads sample ``value`` in a loader that was not restored."""
    if path == "pipeline":
        return value % WORKERS
    order = loader._mode.plan.global_order(0).tolist()
    return order.index(value) % WORKERS  # torch hands items to workers round robin


def _check_error(kind: str, error: BaseException, worker: int) -> None:
    text = str(error)
    if kind == "kill":
        assert isinstance(error, WorkerDiedError), repr(error)
        assert error.worker_id == worker and f"worker {worker}" in text, text
    elif kind == "stuck":
        assert isinstance(error, WorkerTimeoutError), repr(error)
        assert error.worker_id == worker and f"worker {worker}" in text, text
    elif kind in ("raise_iter", "raise_map"):
        assert isinstance(error, InjectedError), repr(error)
        assert f"worker process {worker}" in text and "Original Traceback" in text, text
        assert f"injected {kind}" in text, text
    else:
        assert isinstance(error, TypeError), repr(error)
        assert f"worker process {worker}" in text and "cannot be pickled" in text, text
        assert "Original Traceback" in text and "lock" in text, text


def _trial(path: str, kind: str, rng: random.Random, reference: list[Any]) -> str:
    """One injected fault; returns the outcome ("clean") or raises AssertionError."""
    factory = FACTORIES[path]
    kill_step = rng.randrange(1, N - 4) if kind == "kill" else None
    at = None if kind == "kill" else rng.randrange(N)
    loader = factory(kind, at)
    save_every = rng.randrange(1, 6)
    last_state, last_k = loader.save_state_rank(), 0
    seen: list[Any] = []
    error: BaseException | None = None
    killed = -1
    it = iter(loader)
    t0 = time.monotonic()
    try:
        for item in it:
            seen.append(item)
            if len(seen) % save_every == 0:
                last_state, last_k = loader.save_state_rank(), len(seen)
            if kill_step is not None and len(seen) == kill_step:
                killed = rng.randrange(WORKERS)
                os.kill(loader._iterations.live()[-1].torch_iter._workers[killed].pid, signal.SIGKILL)
                t0 = time.monotonic()
                if rng.random() < 0.5:
                    time.sleep(0.2)  # the signal arrives outside a loader call
    except Exception as e:
        error = e
    elapsed = time.monotonic() - t0
    if error is None:
        return "no error (wrong stream)"
    if elapsed > DEADLINE:
        return "hang"
    worker = killed if kind == "kill" else _owner(path, loader, at)  # type: ignore[arg-type]
    _check_error(kind, error, worker)
    assert_streams(seen, reference[: len(seen)], f"{path}/{kind}: items before the fault")
    if path == "dropin" and kind in PER_BATCH:
        # one batch's error, as torch's: the batch counts as consumed, saving works and the
        # iterator goes on with the next batch
        state = loader.save_state_rank()
        assert state.position.consumed == len(seen) + 1, state.position
        assert_streams(list(it), reference[len(seen) + 1 :], f"{path}/{kind}: the iterator after the error")
        fresh = factory()
        fresh.restore_state_rank(decode(encode(state)))
        assert_streams(list(fresh), reference[len(seen) + 1 :], f"{path}/{kind}: restored after the error")
        return "clean"
    # saving the failed loader refuses (a death seen by a save is seen by the next one too)
    with pytest.raises((LoaderUsageError, WorkerDiedError), match="last iteration failed|worker"):
        loader.save_state_rank()
    del it, loader, error
    gc.collect()
    fresh = factory()
    fresh.restore_state_rank(decode(encode(last_state)))
    rest = list(fresh)
    assert_streams(rest, reference[last_k:], f"{path}/{kind}: continuation from step {last_k}")
    return "clean"


@pytest.mark.parametrize("path", ["pipeline", "dropin"])
def test_injected_worker_faults_end_in_clean_errors(path: str) -> None:
    reference = list(FACTORIES[path]())
    assert len(reference) == N
    rng = random.Random(f"faults-{path}")
    for kind, trials in TRIALS.items():
        for _ in range(trials):
            outcome = _trial(path, kind, rng, reference)
            OUTCOMES[f"{path}/{kind}"][outcome] += 1
            assert outcome == "clean", f"{path}/{kind}: {outcome}"
    print(f"\nfault outcomes ({path}):", {k: dict(v) for k, v in OUTCOMES.items() if k.startswith(path)})


def test_save_during_a_worker_death_names_the_worker() -> None:
    # the worker dies between saves (which never wait on it): WorkerDiedError naming it, no hang
    loader = pipeline_loader("stuck", at=1)  # worker 1 gets stuck on its first sample
    it = iter(loader)
    next(it)  # worker 0's first sample
    pid = loader._iterations.live()[-1].torch_iter._workers[1].pid
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        for _ in range(3):
            next(it)
            loader.save_state_rank()
    assert time.monotonic() - t0 < DEADLINE
    assert info.value.worker_id == 1
    del it


@pytest.mark.parametrize("path", ["pipeline", "dropin"])
def test_persistent_loader_starts_new_workers_after_a_worker_death(path: str) -> None:
    def make() -> sl.SavableDataLoader:
        if path == "dropin":
            return sl.SavableDataLoader(
                FaultyMap(N),
                batch_size=None,
                shuffle=True,
                seed=5,
                num_workers=WORKERS,
                multiprocessing_context="fork",
                persistent_workers=True,
            )
        wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=WORKERS, seed=5)
        return sl.SavableDataLoader(
            MapDataset(FaultySource(N, wc), FaultyFn(None, None)),
            batch_size=None,
            worker_config=wc,
            multiprocessing_context="fork",
            persistent_workers=True,
        )

    ref_loader = make()
    reference = [list(ref_loader), list(ref_loader)]
    del ref_loader
    loader = make()
    it = iter(loader)
    next(it), next(it)
    os.kill(loader._iterations.live()[-1].torch_iter._workers[1].pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError):
        for _ in it:
            pass
    del it
    # the next iter() starts the next epoch with new workers
    assert_streams(list(loader), reference[1], f"{path}: epoch after a worker death")
