"""A local shard file read through a descriptor held open since it was opened.

Readers of local shards never touch a memory map of the file's data: a page of a map
whose file was cut short meanwhile (a sync job rewriting shards, a full disk) kills the
process with ``SIGBUS``, between any check and the copy. :class:`HeldFile` reads with
``os.pread`` / ``os.preadv`` instead, where a cut file reads short; together with an
``fstat`` before each read (a file shorter than when it was opened, anywhere), both are a
:class:`~savable_loader.errors.DataError` naming the shard and the byte offset.

:class:`FileRows` reads row ``i`` of an array stored row-contiguously in such a file
(``.npy`` shards, the tensors of ``.pt`` shards) into a fresh tensor.

Example::

    held = HeldFile(path, "shard-00003.npy", size)
    rows = FileRows(held, offset=128, stride=4096, shape=(1024,), dtype=torch.float32)
    rows.read(7)  # bytes [128 + 7 * 4096, 128 + 8 * 4096) as a (1024,) float32 tensor
    held.close()
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from savable_loader.errors import DataError

__all__ = ["FileRows", "HeldFile", "truncated"]


def truncated(name: str, offset: int, found: int, expected: int) -> DataError:
    """The :class:`~savable_loader.errors.DataError` of a shard that became shorter while
    it was open (a sync job rewriting it, a full disk), met reading byte ``offset``."""
    return DataError(
        f"{name}: the shard was truncated while open: reading byte offset {offset}, the file has {found} bytes, "
        f"{expected} expected (something rewrote or cut it during the run); restore the file, then resume "
        "from the last saved state"
    )


class HeldFile:
    """The local file ``path`` of ``size`` bytes (its size now when None; named ``name``
    in messages), open for reading until :meth:`close`."""

    def __init__(self, path: Path | str, name: str, size: int | None = None) -> None:
        self.fd: int | None = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.name = name
        self.size = os.fstat(self.fd).st_size if size is None else size

    def check(self, offset: int) -> None:
        """DataError if the file is now shorter than ``size`` (``offset``: for the message)."""
        if self.fd is None:
            raise DataError(f"{self.name}: read after the shard was closed")
        found = os.fstat(self.fd).st_size
        if found < self.size:
            raise truncated(self.name, offset, found, self.size)

    def get(self, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)``, cut at ``size`` (a range past the end comes
        back short, as from a slice: callers check lengths)."""
        self.check(offset)
        want = max(0, min(length, self.size - offset))
        data = os.pread(self.fd, want, offset) if want else b""  # type: ignore[arg-type]  # checked above
        while len(data) < want:  # a regular file reads short only at its end
            more = os.pread(self.fd, want - len(data), offset + len(data))  # type: ignore[arg-type]
            if not more:
                self._cut(offset + len(data))
            data += more
        return data

    def readinto(self, offset: int, buffer: Any) -> None:
        """Fill the writable buffer ``buffer`` (bytes) from ``offset``; the whole of it must
        lie within ``size``."""
        self.check(offset)
        view = memoryview(buffer).cast("B")
        end = offset + len(view)
        if end > self.size:
            raise DataError(f"{self.name}: bytes [{offset}, {end}) lie past the end of the file ({self.size} bytes)")
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)  # type: ignore[arg-type]  # checked above
            if n == 0:
                self._cut(offset + done)
            done += n

    def _cut(self, offset: int) -> None:
        found = os.fstat(self.fd).st_size  # type: ignore[arg-type]  # open: the caller read from it
        raise truncated(self.name, offset, found, self.size)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


class FileRows:
    """Rows of one array in a :class:`HeldFile`: row ``i`` is the ``nbytes`` contiguous
    bytes at ``offset + i * stride``, read as a C-contiguous tensor of ``shape`` and
    ``dtype`` that owns its memory."""

    def __init__(self, held: HeldFile, offset: int, stride: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.held = held
        self.offset = offset
        self.stride = stride
        self.shape = shape
        self.dtype = dtype
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        try:  # read straight into a NumPy array of the row's type where NumPy has it
            self.numpy: np.dtype[Any] | None = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:  # (bfloat16, float8, ...: read bytes, then view them as the dtype)
            self.numpy = None

    def read(self, i: int) -> torch.Tensor:
        held, at = self.held, self.offset + i * self.stride
        if self.numpy is not None and held.fd is not None and self.nbytes:
            held.check(at)
            out = np.empty(self.shape, self.numpy)
            if at + self.nbytes <= held.size and os.preadv(held.fd, [out], at) == self.nbytes:  # type: ignore[list-item]
                return torch.from_numpy(out)
            held.readinto(at, out.reshape(-1).view(np.uint8))  # a short read: says why
            return torch.from_numpy(out)
        if not self.nbytes:  # (rows with no elements; an empty uint8 array cannot be viewed as wider items)
            held.check(at)
            return torch.empty(self.shape, dtype=self.dtype)
        raw = np.empty(self.nbytes, np.uint8)
        held.readinto(at, raw)
        return torch.from_numpy(raw).view(self.dtype).reshape(self.shape)
