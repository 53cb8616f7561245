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
    is stored in the state itself, with the samples' restore keys (``keys`` is None until
    the wrapped pipeline gives a sample a key). Samples must not be modified in place
    after they are yielded (the state holds copies taken at snapshot time).

    Before yielding a sample the buffer calls ``mark_sample`` with the sample's key (None
    for a sample without one), so random draws above it follow from the key whether or
    not the pipeline can restore samples (the RNG rule of ``SavableDataset``).

    Example::

        ds = ShuffleBufferDataset(source, size=1000)
    """

    # ``ended``: the wrapped dataset has ended this epoch (the buffer drains). A restored
    # buffer then does not run the wrapped pipeline's end of stream a second time (the
    # end-of-stream rule of ``SavableDataset``).
    _savable_fields = ("buffer", "keys", "seed", "draws", "ended")
    _savable_optional = frozenset({"ended"})

    def __init__(self, dataset: SavableDataset, size: int) -> None:
        super().__init__(dataset)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise LoaderUsageError(f"ShuffleBufferDataset size must be a positive int, got {size!r}")
        self.size = size
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.buffer: list[Any] = []
        # None while no buffered sample has a key (no list of Nones in every state of a
        # keyless pipeline); else the key of every buffered sample, None for keyless ones.
        self.keys: list[Any] | None = None
        self.seed = self.worker_config.epoch_seed()
        self.draws = 0
        self.ended = False

    def _pick(self) -> Any:
        buffer, keys = self.buffer, self.keys
        i = draw(self.seed, self.draws) % len(buffer)
        self.draws += 1
        buffer[i], buffer[-1] = buffer[-1], buffer[i]
        key = None
        if keys is not None:
            keys[i], keys[-1] = keys[-1], keys[i]
            key = keys.pop()
        # The yielded sample is not (always) the one just pulled: re-seed for what follows
        # from its key (None: no key, no re-seed).
        self.mark_sample(key)
        return buffer.pop()

    def __iter__(self) -> Iterator[Any]:
        inner = self.dataset
        if not self.ended:
            for sample in inner:
                key = inner.sample_key
                if key is not None and self.keys is None:
                    self.keys = [None] * len(self.buffer)
                self.buffer.append(sample)
                if self.keys is not None:
                    self.keys.append(key)
                if len(self.buffer) >= self.size:
                    yield self._pick()
            self.ended = True
        while self.buffer:
            yield self._pick()

    def restore_sample(self, key: Any) -> Any:
        """The inner sample ``key`` names, re-seeded as when it left the buffer."""
        sample = self.dataset.restore_sample(key)
        self.mark_sample(key)
        return sample

    def config(self) -> dict[str, Any]:
        return {"size": self.size}
