"""LogSampleDataset: a JSON-lines log, per worker, of the restore keys yielded."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import IO, Any

import msgspec

from savable_loader.dataset.base import SavableDataset
from savable_loader.errors import LoaderUsageError
from savable_loader.wrappers.base import BaseWrapperDataset

__all__ = ["LogSampleDataset"]


class LogSampleDataset(BaseWrapperDataset):
    """Passes samples through and logs the restore key of each to a file per worker.

    Each loading context appends to ``{folder}/rank{rank}-worker{worker}.jsonl`` (the
    logical worker; ``worker0`` in-process) one JSON line per sample, written before the
    sample is yielded::

        {"epoch": 3, "rank": 0, "worker": 1, "index": 17, "key": [2, 418]}

    ``index`` counts this wrapper's samples in the worker's epoch (it is state, so it goes
    on after a restore); put the wrapper outermost and it is the loader's per-worker item
    index. To see which data a training step saw, look up the keys of the step's batch
    (``loader.restore_sample`` rebuilds it). After a restore, samples replayed to reach the
    save point are logged again with the same epoch and index: the last line wins.

    Flush policy: files are opened in append mode and line-buffered, so every line is
    handed to the operating system as it is written and survives the worker being killed
    (not a power loss: there is no fsync). ``key`` is null for samples without keys.

    Example::

        ds = LogSampleDataset(BatchDataset(source, 32), "/checkpoints/sample_logs")
    """

    _savable_fields = ("index",)

    def __init__(self, dataset: SavableDataset, folder: str | os.PathLike[str]) -> None:
        super().__init__(dataset)
        if not isinstance(folder, (str, os.PathLike)):
            raise LoaderUsageError(f"LogSampleDataset folder must be a path, got {folder!r}")
        self.folder = os.fspath(folder)
        self._files: dict[str, IO[str]] = {}
        self._pid = os.getpid()
        self.reset_state_own()

    def reset_state_own(self) -> None:
        self.index = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_files"] = {}  # open files do not cross processes
        return state

    def log_path(self, worker: int | None = None) -> str:
        """The log file of ``worker`` (default: the calling worker) on this rank."""
        wc = self.worker_config
        worker = wc.rank_worker_id() if worker is None else worker
        return os.path.join(self.folder, f"rank{wc.rank}-worker{worker}.jsonl")

    def _file(self) -> IO[str]:
        if self._pid != os.getpid():  # a forked copy: the parent's handles are not ours
            self._files, self._pid = {}, os.getpid()
        path = self.log_path()
        f = self._files.get(path)
        if f is None:
            os.makedirs(self.folder, exist_ok=True)
            f = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open across epochs
            self._files[path] = f
        return f

    def __iter__(self) -> Iterator[Any]:
        f = self._file()
        wc = self.worker_config
        inner = self.dataset
        encode = msgspec.json.encode
        for sample in inner:
            key = inner.sample_key
            line = {
                "epoch": wc.active_epoch(),
                "rank": wc.rank,
                "worker": wc.rank_worker_id(),
                "index": self.index,
                "key": key,
            }
            self.index += 1
            f.write(encode(line).decode() + "\n")
            self.sample_key = key
            yield sample

    def restore_sample(self, key: Any) -> Any:
        """The sample with the inner key ``key`` (not logged)."""
        return self.dataset.restore_sample(key)

    def config(self) -> dict[str, Any]:
        return {}
