"""ShuffleBufferDataset: approximate shuffling of a stream through a buffer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from savable_loader._seeds import draw
from savable_loader.dataset import SavableDataset
from savable_loader.errors import LoaderUsageError
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["ShuffleBufferDataset"]


class ShuffleBufferDataset(BaseWrapperDataset):
    """Keeps ``size`` samples in a buffer and yields a random one as each new one arrives.

    The buffer's samples and its own counter-based RNG (a seed and a draw count) are
    part of the state, so a restore needs no random access into the source: the buffer
    is stored in the state itself, with the samples' restore keys (when the wrapped
    pipeline gives keys; ``keys`` is None otherwise). Samples must not be
    modified in place after they are yielded (the state holds copies taken at snapshot
    time).

    Example::

        ds = ShuffleBufferDataset(source, size=1000)
    """

    _savable_fields = ("buffer", "keys", "seed", "draws")

    def __init__(self, dataset: SavableDataset, size: int) -> None:
        super().__init__(dataset)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise LoaderUsageError(f"ShuffleBufferDataset size must be a positive int, got {size!r}")
        self.size = size
        # Keys are kept only for a pipeline that can rebuild samples: otherwise they would
        # be a list of Nones as long as the buffer in every state.
        self._keyed = dataset.can_restore_sample()
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.buffer: list[Any] = []
        self.keys: list[Any] | None = [] if self._keyed else None
        self.seed = self.worker_config.epoch_seed()
        self.draws = 0

    def _pick(self) -> Any:
        buffer, keys = self.buffer, self.keys
        i = draw(self.seed, self.draws) % len(buffer)
        self.draws += 1
        buffer[i], buffer[-1] = buffer[-1], buffer[i]
        key = None
        if keys is not None:
            keys[i], keys[-1] = keys[-1], keys[i]
            key = keys.pop()
        if key is None:
            self.sample_key = None
        else:
            # The yielded sample is not the one just pulled: re-seed for what follows.
            self.mark_sample(key)
        return buffer.pop()

    def __iter__(self) -> Iterator[Any]:
        inner = self.dataset
        keys = self.keys
        for sample in inner:
            self.buffer.append(sample)
            if keys is not None:
                keys.append(inner.sample_key)
            if len(self.buffer) >= self.size:
                yield self._pick()
        while self.buffer:
            yield self._pick()

    def restore_sample(self, key: Any) -> Any:
        """The inner sample ``key`` names, re-seeded as when it left the buffer."""
        sample = self.dataset.restore_sample(key)
        self.mark_sample(key)
        return sample

    def config(self) -> dict[str, Any]:
        return {"size": self.size}
