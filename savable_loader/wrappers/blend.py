"""BlendDataset: draw every sample from one of several datasets, at random by weight."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

from savable_loader.dataset.base import SavableDataset, wrap_key
from savable_loader.errors import LoaderUsageError
from savable_loader.rng.formulas import draw
from savable_loader.wrappers.base import check_datasets, split_index_key

__all__ = ["BlendDataset"]

_EXHAUSTED_POLICIES = ("drop", "stop")


class BlendDataset(SavableDataset):
    """Yields samples of ``datasets``, choosing the source of each at random by ``weights``.

    The choice comes from a counter-based RNG of the blend's own (a seed from
    ``worker_config.epoch_seed()`` and a draw count, both state), so it does not touch the
    global RNGs and a restore repeats it exactly. Weights need not sum to one; each must
    be positive and finite (default: all equal).

    When a dataset runs out within an epoch, ``exhausted`` decides:

    * ``"drop"`` (default): it is left out and the others are drawn with their weights
      renormalised; the epoch ends when every dataset is exhausted, so every sample of
      every dataset is yielded once (like Energon's blend and torchdata's multiplexer).
    * ``"stop"``: the epoch ends at once, so the mix keeps its ratio to the end (like
      Hugging Face ``interleave_datasets(stopping_strategy="first_exhausted")``). Wrap a
      dataset in ``RepeatDataset`` to make it endless instead.

    Every dataset must have the same ``WorkerConfig``. Restore keys are
    ``[dataset index, inner key]``.

    Example::

        ds = BlendDataset([web, books], weights=[0.7, 0.3])
    """

    _savable_fields = ("seed", "draws", "alive")

    def __init__(
        self,
        datasets: Sequence[SavableDataset],
        weights: Sequence[float] | None = None,
        *,
        exhausted: str = "drop",
    ) -> None:
        datasets = check_datasets("BlendDataset", datasets)
        super().__init__(datasets[0].worker_config)
        if weights is None:
            weights = [1.0] * len(datasets)
        if not isinstance(weights, (list, tuple)) or len(weights) != len(datasets):
            raise LoaderUsageError(
                f"BlendDataset weights must be a list of {len(datasets)} numbers (one per dataset), got {weights!r}"
            )
        for i, w in enumerate(weights):
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                raise LoaderUsageError(f"BlendDataset weights[{i}] must be a positive finite number, got {w!r}")
        if exhausted not in _EXHAUSTED_POLICIES:
            raise LoaderUsageError(f"BlendDataset exhausted must be one of {_EXHAUSTED_POLICIES}, got {exhausted!r}")
        self.datasets = datasets
        self.weights = [float(w) for w in weights]
        self.exhausted = exhausted
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.seed = self.worker_config.epoch_seed()
        self.draws = 0
        self.alive = [True] * len(self.datasets)

    def children(self) -> Sequence[SavableDataset]:
        return self.datasets

    def _choose(self) -> int:
        """The index of the next dataset to draw from, among those still alive."""
        total = sum(w for w, a in zip(self.weights, self.alive) if a)
        u = draw(self.seed, self.draws) / 2.0**64 * total
        self.draws += 1
        acc = 0.0
        last = 0
        for i, (w, a) in enumerate(zip(self.weights, self.alive)):
            if not a:
                continue
            acc += w
            last = i
            if u < acc:
                return i
        return last  # rounding: u within the last ulp of the total

    def __iter__(self) -> Iterator[Any]:
        iterators = [iter(ds) for ds in self.datasets]
        while any(self.alive):
            i = self._choose()
            try:
                sample = next(iterators[i])
            except StopIteration:
                self.alive[i] = False
                if self.exhausted == "stop":
                    self.alive = [False] * len(self.datasets)
                continue
            self.sample_key = wrap_key(i, self.datasets[i].sample_key)
            yield sample

    def restore_sample(self, key: Any) -> Any:
        """The sample of dataset ``key[0]`` whose inner key is ``key[1]``."""
        index, inner = split_index_key("BlendDataset", key, len(self.datasets))
        return self.datasets[index].restore_sample(inner)

    def config(self) -> dict[str, Any]:
        return {"weights": self.weights, "exhausted": self.exhausted}
