"""Helpers of the clock tests (``test_clock.py``, ``test_timed.py``): a clock the test
moves, and small pipelines whose stages cost known seconds of it."""

from __future__ import annotations

from typing import Any

import pytest

import savable_loader as sl
from savable_loader.stats import clock as clock_module
from savable_loader.stats import timed as timed_module
from savable_loader.stats.clock import StageClock
from savable_loader.stats.timed import activate


class FakeTime:
    """``time.perf_counter()`` as the test moves it (``sleep``); each read may cost
    ``read_cost`` seconds."""

    def __init__(self, read_cost: float = 0.0) -> None:
        self.now = 1000.0
        self.read_cost = read_cost

    def __call__(self) -> float:
        self.now += self.read_cost
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def clear_costs() -> None:
    """Forget the clock-read and wrapper costs measured in this process (cached: measured
    again, on the clock ``_now`` is then, by the next ``StageClock``)."""
    clock_module._read_cost.cache_clear()
    clock_module._layer_cost.cache_clear()


def use_fake(monkeypatch: pytest.MonkeyPatch, t: FakeTime) -> FakeTime:
    """``t`` as the clock's and the timed iterators' ``_now``, the costs measured on it."""
    monkeypatch.setattr(clock_module, "_now", t)
    monkeypatch.setattr(timed_module, "_now", t)
    clear_costs()
    return t


WC = sl.WorkerConfig(rank=0, world_size=1, num_workers=0, seed=0)


class Source(sl.SavableDataset):
    """The integers below ``n``, each costing ``cost`` seconds of ``fake`` time."""

    def __init__(self, n: int, fake: FakeTime, cost: float = 1.0) -> None:
        super().__init__(WC)
        self.n, self.fake, self.cost = n, fake, cost

    def __iter__(self):
        for i in range(self.n):
            self.fake.sleep(self.cost)
            yield i

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


class Wrapper(sl.SavableDataset):
    """A dataset over ``inner`` (a stage that is not a source)."""

    def __init__(self, inner: sl.SavableDataset) -> None:
        super().__init__(WC)
        self.inner = inner

    def children(self):
        return [self.inner]

    def config(self) -> dict[str, Any]:
        return {}


def sleeper(fake: FakeTime, cost: float):
    def step(x):  # (every sleeper is named `step`)
        fake.sleep(cost)
        return x

    return step


def stages(clock: StageClock) -> dict[str, tuple[float, int, bool]]:
    return {name: (seconds, items, source) for name, seconds, items, source in clock.take()}


def timed_run(clock: StageClock, dataset: sl.SavableDataset) -> list[Any]:
    with activate(clock):
        return list(iter(dataset))
