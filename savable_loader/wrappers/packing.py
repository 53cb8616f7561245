"""PackingDataset: pack variable-length token sequences into rows of a fixed length."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from savable_loader.dataset import SavableDataset
from savable_loader.errors import LoaderUsageError, RestoreKeyError
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["PackingDataset"]

_STRATEGIES = ("greedy", "best_fit")


class PackingDataset(BaseWrapperDataset):
    """Packs documents (1-D token tensors or lists of ints) into rows of ``row_length``.

    Every row is exactly ``row_length`` tokens long; there is no padding. Strategies:

    * ``"greedy"``: documents are laid end to end; a document that does not fit in the
      rest of a row goes on at the start of the next one. Nothing is cropped.
    * ``"best_fit"``: every row starts with a document start. From a buffer of
      ``buffer_size`` candidate documents, the row takes the longest that fits in its
      remaining space (the earliest of equals), again and again; when none fits, the
      shortest candidate is cropped to fill the row exactly and its rest is dropped
      (counted in ``tokens_cropped``). Documents longer than a row are cropped too.

    ``bos``: a token id prepended to every document (expected without one), so that with
    ``best_fit`` every row starts with ``bos``. At the end of the stream a last, partial
    row is not yielded: its tokens are counted in ``tokens_dropped``. Both counters are
    per worker, state, and readable as attributes (or in a saved state).

    State: the buffer (``best_fit``), the unplaced rest of the current document
    (``greedy``), the counters and whether the wrapped dataset has ended. Rows are built
    whole before they are yielded.
    A row's restore key lists its pieces ``[document key, start, stop]`` (offsets in the
    document, ``bos`` included); it is marked (``mark_sample``) before the row is yielded,
    so random draws downstream follow from it. Rows have the dtype of the documents
    (``torch.long`` for lists).

    Example::

        ds = PackingDataset(tokenized, row_length=2048, strategy="best_fit", bos=1)
    """

    # ``ended`` (best_fit): the wrapped dataset has ended this epoch and the buffer
    # drains; a restore then does not run its end of stream again (see ``SavableDataset``).
    _savable_fields = (
        "carry",
        "carry_key",
        "carry_start",
        "buffer",
        "keys",
        "tokens_cropped",
        "tokens_dropped",
        "ended",
    )
    _savable_optional = frozenset({"ended"})

    def __init__(
        self,
        dataset: SavableDataset,
        row_length: int,
        *,
        strategy: str = "greedy",
        buffer_size: int = 16,
        bos: int | None = None,
    ) -> None:
        super().__init__(dataset)
        if not isinstance(row_length, int) or isinstance(row_length, bool) or row_length < 1:
            raise LoaderUsageError(f"PackingDataset row_length must be a positive int, got {row_length!r}")
        if strategy not in _STRATEGIES:
            raise LoaderUsageError(f"PackingDataset strategy must be one of {_STRATEGIES}, got {strategy!r}")
        if not isinstance(buffer_size, int) or isinstance(buffer_size, bool) or buffer_size < 1:
            raise LoaderUsageError(f"PackingDataset buffer_size must be a positive int, got {buffer_size!r}")
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
            raise LoaderUsageError(f"PackingDataset bos must be None or an int token id, got {bos!r}")
        self.row_length = row_length
        self.strategy = strategy
        self.buffer_size = buffer_size
        self.bos = bos
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.carry: torch.Tensor | None = None  # greedy: the unplaced rest of a document
        self.carry_key: Any = None
        self.carry_start = 0
        self.buffer: list[torch.Tensor] = []  # best_fit: candidate documents
        self.keys: list[Any] = []
        self.tokens_cropped = 0
        self.tokens_dropped = 0
        self.ended = False

    def _document(self, sample: Any) -> torch.Tensor:
        if isinstance(sample, list):
            doc = torch.tensor(sample, dtype=torch.long)
        elif isinstance(sample, torch.Tensor):
            doc = sample
        else:
            raise LoaderUsageError(
                f"PackingDataset documents must be 1-D tensors or lists of ints, got {type(sample).__qualname__}"
            )
        if doc.dim() != 1:
            raise LoaderUsageError(f"PackingDataset documents must be 1-D, got a tensor of shape {tuple(doc.shape)}")
        if self.bos is not None:
            doc = torch.cat([torch.tensor([self.bos], dtype=doc.dtype), doc])
        return doc

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.strategy == "greedy":
            return self._greedy()
        return self._best_fit()

    def _greedy(self) -> Iterator[torch.Tensor]:
        inner = self.dataset
        it = iter(inner)
        while True:
            parts: list[torch.Tensor] = []
            pieces: list[list[Any]] = []
            space = self.row_length
            while space > 0:
                if self.carry is None:
                    try:
                        sample = next(it)
                    except StopIteration:
                        self.tokens_dropped += self.row_length - space
                        return
                    doc = self._document(sample)
                    if len(doc) == 0:
                        continue
                    self.carry, self.carry_key, self.carry_start = doc, inner.sample_key, 0
                take = min(space, len(self.carry))
                parts.append(self.carry[:take])
                pieces.append([self.carry_key, self.carry_start, self.carry_start + take])
                space -= take
                if take == len(self.carry):
                    self.carry, self.carry_key, self.carry_start = None, None, 0
                else:
                    self.carry = self.carry[take:]
                    self.carry_start += take
            self._mark(pieces)
            yield torch.cat(parts)

    def _best_fit(self) -> Iterator[torch.Tensor]:
        inner = self.dataset
        it: Iterator[Any] = iter(()) if self.ended else iter(inner)
        buffer, keys = self.buffer, self.keys

        def fill() -> None:
            while len(buffer) < self.buffer_size and not self.ended:
                try:
                    sample = next(it)
                except StopIteration:
                    self.ended = True
                    return
                doc = self._document(sample)
                if len(doc):
                    buffer.append(doc)
                    keys.append(inner.sample_key)

        while True:
            parts: list[torch.Tensor] = []
            pieces: list[list[Any]] = []
            space = self.row_length
            while space > 0:
                fill()
                if not buffer:
                    self.tokens_dropped += self.row_length - space
                    return
                best = -1
                for i, doc in enumerate(buffer):
                    if len(doc) <= space and (best < 0 or len(doc) > len(buffer[best])):
                        best = i
                if best >= 0:
                    doc, key = buffer.pop(best), keys.pop(best)
                    parts.append(doc)
                    pieces.append([key, 0, len(doc)])
                    space -= len(doc)
                else:  # nothing fits: crop the shortest candidate to fill the row exactly
                    shortest = min(range(len(buffer)), key=lambda i: len(buffer[i]))
                    doc, key = buffer.pop(shortest), keys.pop(shortest)
                    parts.append(doc[:space])
                    pieces.append([key, 0, space])
                    self.tokens_cropped += len(doc) - space
                    space = 0
            self._mark(pieces)
            yield torch.cat(parts)

    def _mark(self, pieces: list[list[Any]]) -> None:
        # the RNG rule: re-seed from the row's key (None: a piece has no key, no re-seed)
        self.mark_sample(None if any(key is None for key, _, _ in pieces) else pieces)

    def restore_sample(self, key: Any) -> torch.Tensor:
        """The row made of the pieces ``[[document key, start, stop], ...]``."""
        if not isinstance(key, (list, tuple)) or not key:
            raise RestoreKeyError(
                f"PackingDataset key must be a non-empty list of [document key, start, stop], got {key!r}"
            )
        parts = []
        for piece in key:
            if (
                not isinstance(piece, (list, tuple))
                or len(piece) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in piece[1:])
                or not 0 <= piece[1] < piece[2]
            ):
                raise RestoreKeyError(f"PackingDataset key piece must be [document key, start, stop], got {piece!r}")
            doc = self._document(self.dataset.restore_sample(piece[0]))
            if piece[2] > len(doc):
                raise RestoreKeyError(f"PackingDataset key piece {piece!r} ends after the document ({len(doc)} tokens)")
            parts.append(doc[piece[1] : piece[2]])
        self.mark_sample(key)
        return torch.cat(parts)

    def config(self) -> dict[str, Any]:
        return {
            "row_length": self.row_length,
            "strategy": self.strategy,
            "buffer_size": self.buffer_size,
            "bos": self.bos,
        }
