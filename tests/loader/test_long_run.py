"""Long runs: 20,000 steps, a save every 10 steps, 2 persistent workers, tiny samples.

(8,000 steps on the drop-in path, whose saves never reach the workers.)

Over several epochs (a shuffle buffer on the pipeline path, a shuffled order on the
drop-in path), the resident memory of the main process and of each worker must stay
flat: the growth from the end of a 2,000-step warm-up to the end is below
``MAX_RSS_GROWTH``. The encoded state size must stay constant up to the width of its
integers: the largest state of the last 1,000 saves is at most ``MAX_STATE_GROWTH``
bytes larger than the largest of the first 1,000 after warm-up. The last state must
still restore to the exact continuation.
"""

from __future__ import annotations

from typing import Any

import psutil
import pytest

import savable_loader as sl
from savable_loader.state import decode, encode
from savable_loader.wrappers import ShuffleBufferDataset
from tests.common import assert_streams

pytestmark = pytest.mark.timeout(300)

STEPS = 20_000
WARMUP = 2_000
SAVE_EVERY = 10
MAX_RSS_GROWTH = 8 << 20  # bytes, per process
MAX_STATE_GROWTH = 16  # bytes


class Count(sl.SavableDataset):
    """The integers below ``n``, split over workers (tiny samples: plain ints)."""

    _savable_fields = ("pos",)

    def __init__(self, n: int, worker_config: sl.WorkerConfig) -> None:
        super().__init__(worker_config)
        self.n = n
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.pos = self.worker_config.rank_worker_id()

    def __iter__(self):
        step = self.worker_config.workers_per_rank
        while self.pos < self.n:
            value = self.pos
            self.pos += step
            yield value

    def config(self) -> dict[str, Any]:
        return {"n": self.n}


class Ints:
    def __len__(self) -> int:
        return 3_000

    def __getitem__(self, i: int) -> int:
        return i


def pipeline() -> sl.SavableDataLoader:
    wc = sl.WorkerConfig(rank=0, world_size=1, num_workers=2, seed=0)
    return sl.SavableDataLoader(
        ShuffleBufferDataset(Count(3_000, wc), size=16),
        batch_size=None,
        worker_config=wc,
        multiprocessing_context="fork",
        persistent_workers=True,
    )


def dropin() -> sl.SavableDataLoader:
    return sl.SavableDataLoader(
        Ints(),
        batch_size=None,
        shuffle=True,
        seed=0,
        num_workers=2,
        multiprocessing_context="fork",
        persistent_workers=True,
    )


def _rss(loader: sl.SavableDataLoader) -> dict[str, int]:
    out = {"main": psutil.Process().memory_info().rss}
    for i, w in enumerate(loader._iterator._workers):
        out[f"worker {i}"] = psutil.Process(w.pid).memory_info().rss
    return out


# The pipeline path (worker snapshot rings, command threads, a save round trip to the
# workers every 10 steps) runs the full 20,000 steps; the drop-in path, whose saves never
# reach the workers, a shorter run.
@pytest.mark.parametrize(("factory", "total"), [(pipeline, STEPS), (dropin, 8_000)], ids=["pipeline", "dropin"])
def test_long_run_memory_and_state_size_stay_flat(factory, total: int) -> None:
    loader = factory()
    steps = 0
    sizes: list[int] = []
    rss_start: dict[str, int] = {}
    last_state = None
    rest: list[Any] = []
    epochs = 0
    while steps < total:
        it = iter(loader)
        for _ in it:
            steps += 1
            if steps % SAVE_EVERY == 0:
                last_state = loader.save_state_rank()
                sizes.append(len(encode(last_state)))
            if steps == WARMUP:
                rss_start = _rss(loader)
            if steps == total:
                rest = list(it)  # the uninterrupted rest of the epoch after the last save
                break
        epochs += 1
    rss_end = _rss(loader)
    assert epochs >= total // 3_000 and rest, (epochs, len(rest))
    growth = {name: rss_end[name] - rss_start[name] for name in rss_start}
    print(f"\nRSS growth over {total - WARMUP} steps (bytes): {growth}; state sizes {min(sizes)}..{max(sizes)}")
    assert all(g < MAX_RSS_GROWTH for g in growth.values()), growth
    first = sizes[WARMUP // SAVE_EVERY : WARMUP // SAVE_EVERY + 1000]
    assert max(sizes[-1000:]) <= max(first) + MAX_STATE_GROWTH, (max(first), max(sizes[-1000:]))
    del it, loader
    fresh = factory()
    fresh.restore_state_rank(decode(encode(last_state)))
    assert_streams(list(fresh), rest, f"continuation of the state saved at step {total}")
