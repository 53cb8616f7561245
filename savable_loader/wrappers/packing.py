"""PackingDataset: pack variable-length token sequences into rows of a fixed length."""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import torch

from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError, RestoreKeyError, StateError
from savable_loader.wrappers._held import check_held_mode, refetch, uses_keys
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["PackingDataset"]

_json_encode = msgspec.json.Encoder().encode
_json_decode = msgspec.json.decode


def _json_text(key: Any) -> str:
    return _json_encode(key).decode()


_STRATEGIES = ("greedy", "best_fit")

#: A row's piece while it is built: ``(document, start, stop)``, offsets in the document
#: with its ``bos`` (``bos`` is never stored: offset 0 is the ``bos`` when there is one).
_Part = tuple[Any, int, int]


class _Candidates:
    """The best-fit buffer: documents grouped by length, so that the longest one that fits
    and the shortest one are found by bisection over the distinct lengths, not by a scan.

    Among documents of one length the earliest buffered comes first (a FIFO per length),
    which is the order a linear scan of the buffer in arrival order gives. ``docs``,
    ``keys`` and ``texts`` keep arrival order (dicts keyed by an arrival number), for the
    state. The state holds the keys as one JSON array text, joined from each key's text
    (made once when the document comes in): a snapshot copies one string, not a thousand
    nested lists.
    """

    __slots__ = ("buckets", "docs", "keyless", "keys", "lengths", "seq", "texts")

    def __init__(self) -> None:
        self.lengths: list[int] = []  # the distinct lengths present, ascending
        self.buckets: dict[int, deque[int]] = {}  # length -> arrival numbers, oldest first
        self.docs: dict[int, tuple[Any, int]] = {}  # arrival number -> (document, length)
        self.keys: dict[int, Any] = {}  # arrival number -> restore key
        self.texts: dict[int, str] = {}  # arrival number -> the key as JSON text ("null": no key)
        self.keyless = 0  # how many held documents have no key
        self.seq = 0

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, doc: Any, length: int, key: Any) -> None:
        seq = self.seq
        self.seq = seq + 1
        self.docs[seq] = (doc, length)
        self.keys[seq] = key
        if key is None:
            self.keyless += 1
            self.texts[seq] = "null"
        else:
            self.texts[seq] = _json_text(key)
        bucket = self.buckets.get(length)
        if bucket is None:
            bucket = self.buckets[length] = deque()
            insort(self.lengths, length)
        bucket.append(seq)

    def longest_fitting(self, space: int) -> int:
        """The index in ``lengths`` of the longest length <= ``space`` (-1: none)."""
        return bisect_right(self.lengths, space) - 1

    def pop(self, at: int) -> tuple[Any, int, Any]:
        """``(document, length, key)`` of the oldest document of length ``lengths[at]``."""
        length = self.lengths[at]
        bucket = self.buckets[length]
        seq = bucket.popleft()
        if not bucket:
            del self.buckets[length]
            del self.lengths[at]
        doc, _ = self.docs.pop(seq)
        key = self.keys.pop(seq)
        del self.texts[seq]
        if key is None:
            self.keyless -= 1
        return doc, length, key


class PackingDataset(BaseWrapperDataset):
    """Packs documents (1-D token lists, NumPy arrays or tensors) into rows of ``row_length``.

    Every row is exactly ``row_length`` tokens long; there is no padding. Strategies:

    * ``"greedy"``: documents are laid end to end; a document that does not fit in the
      rest of a row goes on at the start of the next one. Nothing is cropped.
    * ``"best_fit"``: every row starts with a document start. From a buffer of
      ``buffer_size`` candidate documents, the row takes the longest that fits in its
      remaining space (the earliest of equals), again and again; when none fits, the
      shortest candidate (the earliest of equals) is cropped to fill the row exactly and
      its rest is dropped (counted in ``tokens_cropped``). Documents longer than a row
      are cropped too. The candidates are kept sorted by length: a pick costs a
      bisection, not a scan of the buffer.

    ``refill_chunk``: when the buffer holds fewer than ``buffer_size`` documents, this
    many are pulled at once (1: the buffer holds exactly ``buffer_size``; a loader that
    refills its buffer 128 documents at a time, as nanochat's does, is reproduced with
    ``refill_chunk=128``).

    ``bos``: a token id prepended to every document (expected without one), so that with
    ``best_fit`` every row starts with ``bos``. A document that already starts with
    ``bos`` (a tokenizer that prepends it) is a :class:`LoaderUsageError`: its rows would
    hold two. At the end of the stream a last, partial row is not yielded: its tokens are
    counted in ``tokens_dropped``. Both counters are per worker, state, and readable as
    attributes (or in a saved state).

    State: the documents the buffer holds (``best_fit``), the document being laid out and
    where in it (``greedy``), the counters and whether the wrapped dataset has ended. With
    ``buffer_state="auto"`` (the default) a document is saved as its restore key when the
    wrapped pipeline can rebuild samples from keys (``can_restore_sample()``: shards,
    Parquet rows, polling and Redis sources, with maps and filters above them), and a
    restore fetches and re-maps it (``restore_sample``); else, or with
    ``buffer_state="payload"``, the state holds the tokens themselves. Over a source
    whose read samples may be gone later (``PollingSource``, ``RedisStreamSource``:
    ``samples_may_vanish``) "auto" saves the tokens; ``buffer_state="keys"`` saves keys
    there too (when nothing the buffer holds is trimmed or dropped).
    A row's restore key lists its pieces ``[document key, start, stop]`` (offsets in the
    document, ``bos`` included); it is marked (``mark_sample``) before the row is yielded,
    so random draws downstream follow from it. Rows are tensors with the dtype of the
    documents (``torch.long`` for lists).

    Example::

        ds = PackingDataset(tokenized, row_length=2048, strategy="best_fit", bos=1)
    """

    # ``ended`` (best_fit): the wrapped dataset has ended this epoch and the buffer
    # drains; a restore then does not run its end of stream again (see ``SavableDataset``).
    # ``held``: "keys" when ``carry`` / ``buffer`` are None and the documents are named by
    # ``carry_key`` / ``keys`` alone (fetched again on restore), else "payload". ``keys``:
    # the buffered documents' keys as one JSON array text (null: no key), whatever ``held`` is.
    # ``carry``, ``buffer``, ``keys`` and ``held`` are properties over the live structures.
    _savable_fields = (
        "carry",
        "carry_key",
        "carry_start",
        "buffer",
        "keys",
        "held",
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
        refill_chunk: int = 1,
        bos: int | None = None,
        buffer_state: str = "auto",
    ) -> None:
        super().__init__(dataset)
        if not isinstance(row_length, int) or isinstance(row_length, bool) or row_length < 1:
            raise LoaderUsageError(f"PackingDataset row_length must be a positive int, got {row_length!r}")
        if strategy not in _STRATEGIES:
            raise LoaderUsageError(f"PackingDataset strategy must be one of {_STRATEGIES}, got {strategy!r}")
        if not isinstance(buffer_size, int) or isinstance(buffer_size, bool) or buffer_size < 1:
            raise LoaderUsageError(f"PackingDataset buffer_size must be a positive int, got {buffer_size!r}")
        if not isinstance(refill_chunk, int) or isinstance(refill_chunk, bool) or refill_chunk < 1:
            raise LoaderUsageError(f"PackingDataset refill_chunk must be a positive int, got {refill_chunk!r}")
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
            raise LoaderUsageError(f"PackingDataset bos must be None or an int token id, got {bos!r}")
        check_held_mode("PackingDataset", buffer_state)
        self.row_length = row_length
        self.strategy = strategy
        self.buffer_size = buffer_size
        self.refill_chunk = refill_chunk
        self.bos = bos
        self.buffer_state = buffer_state
        self._by_key: bool | None = None  # buffer_state "auto" decided (on first save)
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self._carry: Any = None  # greedy: the document being laid out (as it came)
        self._carry_length = 0  # its length, bos included
        self.carry_key: Any = None
        self.carry_start = 0  # greedy: where the next row goes on in it (bos included)
        self._candidates = _Candidates()  # best_fit
        self._restored: dict[str, Any] = {}  # fields of a restored state, applied by __iter__
        self.tokens_cropped = 0
        self.tokens_dropped = 0
        self.ended = False

    # -- the state's view of the live structures ----------------------------------------

    def _keys_held(self) -> bool:
        """True if this state names its documents by key (see ``buffer_state``)."""
        if self._by_key is None:
            self._by_key = uses_keys(self.buffer_state, self.dataset)
        if not self._by_key:
            return False
        if self.strategy == "greedy":
            return self._carry is None or self.carry_key is not None
        return self._candidates.keyless == 0

    @property
    def held(self) -> str:
        """What the state holds of the buffer: ``"keys"`` (positions, fetched again at a
        restore) or ``"payload"`` (the documents themselves)."""
        if self._restored:
            return str(self._restored.get("held", "payload"))
        return "keys" if self._keys_held() else "payload"

    @held.setter
    def held(self, value: Any) -> None:
        self._restored["held"] = value

    @property
    def carry(self) -> Any:
        """The part of a document the next row starts with, as the state holds it (None
        when the keys name the documents)."""
        if self._restored:
            return self._restored.get("carry")
        return None if self._keys_held() else self._carry

    @carry.setter
    def carry(self, value: Any) -> None:
        self._restored["carry"] = value

    @property
    def buffer(self) -> list[Any] | None:
        """The buffered documents as the state holds them (None: named by keys, or the
        greedy strategy, which keeps none)."""
        if self._restored:
            return self._restored.get("buffer")
        if self.strategy == "greedy" or self._keys_held():
            return None
        return [doc for doc, _ in self._candidates.docs.values()]

    @buffer.setter
    def buffer(self, value: Any) -> None:
        self._restored["buffer"] = value

    @property
    def keys(self) -> str:
        """The buffered documents' keys, in arrival order, as one JSON array text (null: a
        document without a key)."""
        if self._restored:
            return str(self._restored.get("keys", "[]"))
        return "[" + ",".join(self._candidates.texts.values()) + "]"

    @keys.setter
    def keys(self, value: Any) -> None:
        self._restored["keys"] = value

    def _apply_restored(self) -> None:
        """Rebuild the live structures from a restored state (fetching documents saved by
        key again through the wrapped pipeline's ``restore_sample``)."""
        restored, self._restored = self._restored, {}
        by_key = restored.get("held") == "keys"
        if self.strategy == "greedy":
            doc = restored.get("carry")
            if by_key and self.carry_key is not None:
                doc = refetch(self.dataset, [self.carry_key])[0]
            if doc is not None:
                self._carry, self._carry_length = doc, self._length(doc)
            return
        text = restored.get("keys", "[]")
        try:
            keys = _json_decode(text) if isinstance(text, str) else None
        except msgspec.DecodeError:
            keys = None
        if not isinstance(keys, list):
            raise StateError(f"PackingDataset state: keys must be a JSON array text, got {text!r:.80}")
        docs = refetch(self.dataset, keys) if by_key else list(restored.get("buffer") or [])
        if len(docs) != len(keys):
            raise RestoreKeyError(f"PackingDataset state holds {len(docs)} documents and {len(keys)} keys")
        for doc, key in zip(docs, keys):
            length = self._length(doc)
            if length:
                self._candidates.add(doc, length, key)

    # -- documents and rows -------------------------------------------------------------

    def _length(self, doc: Any) -> int:
        """The document's length with its ``bos``, after checking what it is."""
        cls = type(doc)
        if cls is list:
            pass
        elif cls is np.ndarray:
            if doc.ndim != 1 or doc.dtype.kind not in "iu":
                raise LoaderUsageError(
                    f"PackingDataset documents must be 1-D integer arrays, got an array of shape {doc.shape} "
                    f"and dtype {doc.dtype}"
                )
        elif isinstance(doc, torch.Tensor):
            if doc.dim() != 1:
                raise LoaderUsageError(
                    f"PackingDataset documents must be 1-D, got a tensor of shape {tuple(doc.shape)}"
                )
        else:
            raise LoaderUsageError(
                "PackingDataset documents must be 1-D tensors, NumPy arrays or lists of ints, "
                f"got {type(doc).__qualname__}"
            )
        n = len(doc)
        bos = self.bos
        if bos is None:
            return n
        if n and doc[0] == bos:
            raise LoaderUsageError(
                f"PackingDataset bos={bos}: a document already starts with token {bos} (the tokenizer "
                "prepends it?), so its rows would hold it twice; drop bos= or tokenize without BOS"
            )
        return n + 1

    def _row(self, parts: list[_Part]) -> torch.Tensor:
        """The row made of ``parts``: a tensor of the documents' dtype."""
        bos = self.bos
        spans = _doc_spans(parts, bos)
        first = parts[0][0]
        if type(first) is list and all(type(doc) is list for doc, _, _ in parts):
            flat: list[int] = []
            for doc, a, b, lead in spans:
                if lead:
                    flat.append(bos)  # type: ignore[arg-type]
                flat += doc if a == 0 and b == len(doc) else doc[a:b]
            # (NumPy reads a list of ints about 20x faster than torch.tensor does)
            return torch.from_numpy(np.array(flat, dtype=np.int64))
        size = sum(b - a for _, a, b in parts)
        numpy_out = isinstance(first, np.ndarray)
        if numpy_out:
            out: Any = np.empty(size, dtype=first.dtype)
        else:
            out = torch.empty(size, dtype=first.dtype if isinstance(first, torch.Tensor) else torch.long)
        at = 0
        for doc, a, b, lead in spans:
            if lead:
                out[at] = bos
                at += 1
            if b > a:
                piece = doc[a:b]
                if numpy_out:
                    out[at : at + b - a] = piece.numpy() if isinstance(piece, torch.Tensor) else piece
                else:
                    out[at : at + b - a] = piece if isinstance(piece, torch.Tensor) else torch.as_tensor(piece)
            at += b - a
        return torch.from_numpy(out) if numpy_out else out

    # -- iteration ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self._restored:
            self._apply_restored()
        if self.strategy == "greedy":
            return self._greedy()
        return self._best_fit()

    def _greedy(self) -> Iterator[torch.Tensor]:
        inner = self.dataset
        it = iter(inner)
        row_length = self.row_length
        while True:
            parts: list[_Part] = []
            pieces: list[list[Any]] = []
            space = row_length
            while space > 0:
                if self._carry is None:
                    try:
                        sample = next(it)
                    except StopIteration:
                        self.tokens_dropped += row_length - space
                        return
                    length = self._length(sample)
                    if length == 0:
                        continue
                    self._carry, self._carry_length = sample, length
                    self.carry_key, self.carry_start = inner.sample_key, 0
                start = self.carry_start
                stop = min(self._carry_length, start + space)
                parts.append((self._carry, start, stop))
                pieces.append([self.carry_key, start, stop])
                space -= stop - start
                if stop == self._carry_length:
                    self._carry, self.carry_key, self.carry_start = None, None, 0
                else:
                    self.carry_start = stop
            self._mark(pieces)
            yield self._row(parts)

    def _best_fit(self) -> Iterator[torch.Tensor]:
        inner = self.dataset
        it: Iterator[Any] = iter(()) if self.ended else iter(inner)
        candidates = self._candidates
        row_length, size, chunk = self.row_length, self.buffer_size, self.refill_chunk
        lengths, measure, add = candidates.lengths, self._length, candidates.add
        while True:
            parts: list[_Part] = []
            pieces: list[list[Any]] = []
            space = row_length
            while space > 0:
                while len(candidates.docs) < size and not self.ended:
                    for _ in range(chunk):
                        try:
                            sample = next(it)
                        except StopIteration:
                            self.ended = True
                            break
                        length = measure(sample)
                        if length:
                            add(sample, length, inner.sample_key)
                if not lengths:
                    self.tokens_dropped += row_length - space
                    return
                at = bisect_right(lengths, space) - 1
                if at >= 0:
                    doc, length, key = candidates.pop(at)
                    parts.append((doc, 0, length))
                    pieces.append([key, 0, length])
                    space -= length
                else:  # nothing fits: crop the shortest candidate to fill the row exactly
                    doc, length, key = candidates.pop(0)
                    parts.append((doc, 0, space))
                    pieces.append([key, 0, space])
                    self.tokens_cropped += length - space
                    space = 0
            self._mark(pieces)
            yield self._row(parts)

    def _mark(self, pieces: list[list[Any]]) -> None:
        # the RNG rule: re-seed from the row's key (None: a piece has no key, no re-seed)
        self.mark_sample(None if any(key is None for key, _, _ in pieces) else pieces)

    def restore_sample(self, key: Any) -> torch.Tensor:
        """The row made of the pieces ``[[document key, start, stop], ...]``."""
        if not isinstance(key, (list, tuple)) or not key:
            raise RestoreKeyError(
                f"PackingDataset key must be a non-empty list of [document key, start, stop], got {key!r}"
            )
        parts: list[_Part] = []
        for piece in key:
            if (
                not isinstance(piece, (list, tuple))
                or len(piece) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in piece[1:])
                or not 0 <= piece[1] < piece[2]
            ):
                raise RestoreKeyError(f"PackingDataset key piece must be [document key, start, stop], got {piece!r}")
            doc = self.dataset.restore_sample(piece[0])
            length = self._length(doc)
            if piece[2] > length:
                raise RestoreKeyError(f"PackingDataset key piece {piece!r} ends after the document ({length} tokens)")
            parts.append((doc, piece[1], piece[2]))
        self.mark_sample(key)
        return self._row(parts)

    def config(self) -> dict[str, Any]:
        return {
            "row_length": self.row_length,
            "strategy": self.strategy,
            "buffer_size": self.buffer_size,
            "refill_chunk": self.refill_chunk,
            "bos": self.bos,
        }


def _doc_spans(parts: list[_Part], bos: int | None) -> list[tuple[Any, int, int, bool]]:
    """``(document, start, end, lead)`` per part of a row, in the document's own
    coordinates: a part's span counts the BOS the packer puts before each document
    (``lead``: this part begins with it, the document's first token follows)."""
    if bos is None:
        return [(doc, a, b, False) for doc, a, b in parts]
    return [(doc, 0, b - 1, True) if a == 0 else (doc, a - 1, b - 1, False) for doc, a, b in parts]
