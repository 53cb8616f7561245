"""HeldFile and FileRows: bytes and rows of a local shard read with pread, a file cut
while open a DataError naming the shard and the offset, and, for every format read from
a local file, no read through a memory map (a cut file is an error even with the size
check switched off, never a SIGBUS)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from savable_loader.errors import DataError
from savable_loader.sources.shards.held_file import FileRows, HeldFile

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).parents[2]
CUT = r"the shard was truncated while open: reading byte offset \d+, the file has \d+ bytes, \d+ expected"


def _file(tmp_path: Path, n: int = 1000) -> Path:
    path = tmp_path / "shard.bin"
    path.write_bytes(bytes(range(256)) * (n // 256) + bytes(range(n % 256)))
    return path


def test_get_reads_ranges_and_is_short_past_the_end(tmp_path: Path) -> None:
    path = _file(tmp_path)
    data = path.read_bytes()
    held = HeldFile(path, "shard.bin")
    assert held.size == 1000
    for offset, length in [(0, 10), (250, 20), (990, 10), (995, 10), (1000, 5), (1200, 5), (0, 0)]:
        assert held.get(offset, length) == data[offset : offset + length]
    held.close()


def test_a_cut_file_is_a_data_error_naming_it_and_the_offset(tmp_path: Path) -> None:
    path = _file(tmp_path)
    held = HeldFile(path, "shard.bin")
    os.truncate(path, 500)
    with pytest.raises(DataError, match=rf"^shard.bin: {CUT}"):
        held.get(100, 10)  # before the cut: the size check sees it
    with pytest.raises(DataError, match=r"reading byte offset 600, the file has 500 bytes, 1000 expected"):
        held.readinto(600, bytearray(10))


def test_a_read_that_comes_back_short_is_a_data_error_without_the_size_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The size check and the read are two steps: a cut between them reads short."""
    path = _file(tmp_path)
    held = HeldFile(path, "shard.bin")
    monkeypatch.setattr(HeldFile, "check", lambda self, offset: None)
    os.truncate(path, 500)
    assert held.get(100, 10) == path.read_bytes()[100:110]  # before the cut: the same bytes
    with pytest.raises(DataError, match=r"reading byte offset 500, the file has 500 bytes, 1000 expected"):
        held.get(490, 20)
    with pytest.raises(DataError, match=r"reading byte offset 500, the file has 500 bytes, 1000 expected"):
        held.readinto(480, np.empty(40, np.uint8))


def test_readinto_past_the_end_and_after_close(tmp_path: Path) -> None:
    path = _file(tmp_path)
    held = HeldFile(path, "shard.bin", 1000)
    with pytest.raises(DataError, match=r"^shard.bin: bytes \[990, 1010\) lie past the end of the file \(1000 bytes\)"):
        held.readinto(990, bytearray(20))
    held.close()
    held.close()
    with pytest.raises(DataError, match="read after the shard was closed"):
        held.get(0, 1)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.bool, torch.complex128, torch.int8, torch.uint8, torch.int64]
)
@pytest.mark.parametrize("shape", [(), (3,), (2, 3), (2, 0)])
def test_file_rows_read_each_row_as_written(tmp_path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    array = (torch.arange(5 * int(np.prod(shape, dtype=np.int64))) % 7).to(dtype).reshape(5, *shape)
    raw = array.contiguous().view(torch.uint8).numpy().tobytes() if array.numel() else b""
    path = tmp_path / "rows.bin"
    path.write_bytes(b"H" * 16 + raw)
    held = HeldFile(path, "rows.bin")
    stride = len(raw) // 5
    rows = FileRows(held, 16, stride, shape, dtype)
    for i in range(5):
        row = rows.read(i)
        assert row.dtype == dtype and row.shape == shape and torch.equal(row, array[i])
    held.close()


_NO_CHECK = """
import os, sys
from pathlib import Path
import numpy as np, torch
from savable_loader.errors import DataError
from savable_loader.sources import ShardedFileDataset, write_shards
from savable_loader.sources.shards.held_file import HeldFile
from tests.sources.test_sharded_source import wconf, worker_stream
from tests.sources.test_shard_formats import make_folder

fmt, folder = sys.argv[1], Path(sys.argv[2])
if fmt == "npy":
    write_shards(folder, [np.full((64, 4096), s, np.uint8) for s in range(2)])
elif fmt == "pt":
    write_shards(folder, [{"x": torch.full((64, 4096), s, dtype=torch.uint8)} for s in range(2)], fmt=".pt")
else:
    make_folder(fmt, folder, [16, 16])
ds = ShardedFileDataset(folder, wconf(), shuffle=False)
HeldFile.check = lambda self, offset: None  # only the reads themselves can see the cut
from savable_loader.config import _ActiveWorker
with _ActiveWorker(0, 0):
    ds.reset_state_deep()
    try:
        for n, _ in enumerate(ds):
            if n == 0:  # the first shard is open: cut every shard to a quarter
                for shard in folder.iterdir():
                    if shard.suffix in (".npy", ".pt", ".tar", ".mds", ".bin"):
                        os.truncate(shard, shard.stat().st_size // 4)
    except DataError as e:
        print("CAUGHT", e)
"""


@pytest.mark.parametrize("fmt", ["npy", "pt", "tar", "mds", "litdata"])
def test_no_format_reads_a_local_shard_through_a_memory_map(tmp_path: Path, fmt: str) -> None:
    """A shard cut to a quarter while open, with the size check off: each read past the
    cut reads short and says so. A read through a memory map would kill the process with
    SIGBUS here (exit status -7)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", _NO_CHECK, fmt, str(tmp_path / "shards")],
        capture_output=True,
        text=True,
        timeout=200,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-3000:])
    assert re.search(rf"^CAUGHT \S+: ({CUT}|.*truncated)", out.stdout), out.stdout + out.stderr[-3000:]
