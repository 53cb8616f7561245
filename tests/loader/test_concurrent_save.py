"""save_state_rank() from checkpoint threads while the training thread iterates.

Supported and documented (``SavableDataLoader.save_state_rank``): every state taken
concurrently is the position between two yielded items. The test runs two saving
threads against a training thread over three epochs (epoch boundaries included), checks
that no save failed and that the training stream is the uninterrupted one, then restores
a spread of the concurrent states and compares each continuation with the reference.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import savable_loader as sl
from savable_loader.state import decode, encode
from savable_loader.wrappers import MapDataset
from tests.common import RandomMapDataset, RangeSource, assert_streams, epochs_of

pytestmark = pytest.mark.timeout(180)

EPOCHS = 2


def _noise(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + int(torch.randint(0, 9, ()))


def pipeline() -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=4)
    return sl.SavableDataLoader(
        MapDataset(RangeSource(30, wc), _noise), batch_size=None, worker_config=wc, multiprocessing_context="fork"
    )


def dropin() -> sl.SavableDataLoader:
    return sl.SavableDataLoader(
        RandomMapDataset(50), batch_size=3, shuffle=True, seed=4, num_workers=2, multiprocessing_context="fork"
    )


def _items_before(state: Any, lengths: list[int], batch_size: int | None) -> int:
    position = state.position
    base = sum(lengths[: position.epoch])
    if hasattr(position, "workers"):
        return base + sum(ws.index for ws in position.workers)
    return base + math.ceil(position.consumed / (batch_size or 1))


@pytest.mark.parametrize("factory", [pipeline, dropin], ids=["pipeline", "dropin"])
def test_saves_from_other_threads_are_consistent(factory: Callable[[], sl.SavableDataLoader]) -> None:
    reference = epochs_of(factory(), EPOCHS)
    lengths = [len(e) for e in reference]
    flat = [x for e in reference for x in e]
    loader = factory()
    states: list[Any] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def saver(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            try:
                states.append(loader.save_state_rank())
            except BaseException as e:
                errors.append(e)
                return
            time.sleep(rng.random() * 0.003)

    threads = [threading.Thread(target=saver, args=(seed,)) for seed in range(2)]
    for t in threads:
        t.start()
    seen: list[Any] = []
    try:
        for _ in range(EPOCHS):
            for item in loader:
                seen.append(item)
                time.sleep(0.002)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    assert_streams(seen, flat, "training stream with concurrent saves")
    assert len(states) > 20, len(states)
    by_k: dict[int, Any] = {}
    for state in states:
        by_k.setdefault(_items_before(state, lengths, loader.batch_size), state)
    ks = sorted(by_k)
    assert len(ks) > 5, ks
    picked = sorted({ks[round(i * (len(ks) - 1) / 4)] for i in range(5)})
    for k in picked:
        fresh = factory()
        fresh.restore_state_rank(decode(encode(by_k[k])))
        rest: list[Any] = []
        ends = {sum(lengths[: e + 1]) for e in range(len(lengths))}
        first = True
        while len(rest) < len(flat) - k:
            chunk = list(fresh)
            # a save at an epoch's last batch restores to that epoch's empty rest
            assert chunk or (first and k in ends), f"k={k}: an empty epoch before the reference ended"
            first = False
            rest.extend(chunk)
        assert_streams(rest, flat[k:], f"continuation of a concurrent save at k={k}")
