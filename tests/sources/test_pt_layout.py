"""storage_offsets: the file offsets of the storages of a ``torch.load(mmap=True)`` result,
checked against the bytes in the file, for the shapes a ``.pt`` shard takes (one tensor,
a dict, shared storages, views, dtypes of every width), and None where they do not fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from savable_loader.sources.shards.pt_layout import storage_offsets


def _saved(tmp_path: Path, value: object) -> tuple[Path, list[torch.Tensor]]:
    path = tmp_path / "shard.pt"
    torch.save(value, path)
    data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    tensors = [data] if isinstance(data, torch.Tensor) else list(data.values())
    return path, tensors


def _bytes_at(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def _views(base: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"x": base[:, 1:], "y": base[2:12], "z": base.t()[:3]}


VALUES = {
    "one tensor": lambda: torch.arange(600, dtype=torch.float32).reshape(100, 6),
    "dict of dtypes": lambda: {
        "a": torch.arange(40, dtype=torch.int64).reshape(10, 4),
        "b": torch.linspace(0, 1, 30, dtype=torch.bfloat16).reshape(10, 3),
        "c": torch.arange(10) % 2 == 0,
        "d": torch.view_as_complex(torch.arange(40, dtype=torch.float32).reshape(10, 2, 2)),
        "e": torch.arange(10, dtype=torch.uint8),
    },
    "shared storage and views": lambda: _views(torch.arange(12 * 5, dtype=torch.int16).reshape(12, 5)),
    "same sizes": lambda: {k: torch.full((8, 8), i, dtype=torch.float32) for i, k in enumerate("pqrs")},
}


@pytest.mark.parametrize("kind", list(VALUES))
def test_offsets_point_at_each_storages_bytes(tmp_path: Path, kind: str) -> None:
    path, tensors = _saved(tmp_path, VALUES[kind]())
    storages = [t.untyped_storage() for t in tensors]
    offsets = storage_offsets(path, storages)
    assert offsets is not None, f"torch {torch.__version__}: the storages of a torch.save file were not found"
    for t, storage, at in zip(tensors, storages, offsets):
        expected = bytes(storage)  # the storage's bytes, through torch's own map
        assert _bytes_at(path, at, storage.nbytes()) == expected, (t.dtype, at)


def test_an_empty_tensor_has_nothing_to_read(tmp_path: Path) -> None:
    path, tensors = _saved(tmp_path, {"a": torch.zeros(0, 3), "b": torch.arange(4)})
    offsets = storage_offsets(path, [t.untyped_storage() for t in tensors])
    assert offsets is not None and offsets[0] == 0
    assert _bytes_at(path, offsets[1], 32) == bytes(tensors[1].untyped_storage())


def test_storages_that_are_not_views_of_the_file_are_not_guessed(tmp_path: Path) -> None:
    """Two storages of the file's sizes, elsewhere in memory: no one base puts both at
    records, so no offsets (one storage alone is matched by its size, which its content
    being that record's makes right however torch maps it)."""
    path, tensors = _saved(tmp_path, {"a": torch.arange(64, dtype=torch.float32), "b": torch.arange(32)})
    elsewhere = [torch.arange(64, dtype=torch.float32).untyped_storage(), torch.arange(32).untyped_storage()]
    assert storage_offsets(path, elsewhere) is None


def test_a_file_that_is_not_a_zip_is_none(tmp_path: Path) -> None:
    path = tmp_path / "shard.pt"
    path.write_bytes(b"not a zip archive at all")
    assert storage_offsets(path, [torch.arange(3).untyped_storage()]) is None
