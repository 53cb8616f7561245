"""Exceptions raised by savable_loader.

Every error the library raises on purpose derives from :class:`SavableLoaderError`, so
``except savable_loader.errors.SavableLoaderError`` catches all of them::

    SavableLoaderError
    ├── StateError                  a state (bytes, file or object) is malformed or foreign
    │   ├── StateVersionError       written by a newer savable-loader: upgrade
    │   └── StateFileError          a state file cannot be written or read (names the path; an OSError)
    ├── ConfigMismatchError         restore under a configuration that cannot be honoured
    ├── LoaderUsageError            the loader was called in a way it does not support
    │   ├── UsageTypeError          an argument of the wrong type (also a TypeError)
    │   └── DatasetContractError    a SavableDataset breaks its contract (say, an unlisted child)
    ├── RestoreKeyError             a restore key cannot be rebuilt (foreign, malformed, unsupported)
    ├── DataError                   data on disk is malformed (shard metadata, shard files)
    ├── ResumeMismatchError         savable_loader.testing.check_resume found a resumed run that differs
    ├── InternalError               an invariant of savable_loader itself broke: a bug, please report it
    └── WorkerError                 a worker process failed (names the worker)
        ├── WorkerDiedError         the worker process exited
        └── WorkerTimeoutError      the worker did not answer in time

Warnings: :class:`UnsavedRngWarning` (a dataset holds a random generator it does not save).

Example::

    try:
        loader.restore_state_rank(state)
    except ConfigMismatchError as e:
        print(e.field, e.saved, e.current)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "ConfigMismatchError",
    "DataError",
    "DatasetContractError",
    "InternalError",
    "LoaderUsageError",
    "RestoreKeyError",
    "ResumeMismatchError",
    "SavableLoaderError",
    "StateError",
    "StateFileError",
    "StateVersionError",
    "UnsavedRngWarning",
    "UsageTypeError",
    "WorkerDiedError",
    "WorkerError",
    "WorkerTimeoutError",
]


class SavableLoaderError(Exception):
    """Base class of every error savable_loader raises on purpose.

    Example::

        try:
            loader.restore_state_rank(sl.state.load_file("loader.state"))
        except SavableLoaderError as e:
            print(f"cannot resume the data, starting over: {e}")
    """


class StateError(SavableLoaderError):
    """A state is malformed, truncated, corrupted or not a savable_loader state.

    Raised by :func:`savable_loader.state.decode`, :func:`savable_loader.state.load_file`
    and by restores handed an object of the wrong kind.

    Example::

        try:
            state = sl.state.load_file("loader.state")
        except StateError as e:   # missing, truncated, bad checksum, not a state
            print(e)              # names the file and the problem
    """


class StateVersionError(StateError):
    """The state was written with a newer schema version than this library knows.

    Example::

        try:
            state = sl.state.decode(data)
        except StateVersionError:
            raise SystemExit("this checkpoint needs a newer savable-loader: pip install -U savable-loader")
    """


class StateFileError(StateError, OSError):
    """A state file cannot be written or read: a missing or read-only folder, a folder
    where the file should be, a full disk.

    The message names the target path and the reason; ``path`` is the target and
    ``errno`` the operating system's error number (None if there was none). Also an
    ``OSError``, so ``except OSError`` around a save keeps working.

    Example::

        try:
            sl.state.save_file("ckpt/loader.state", state)
        except StateFileError as e:
            print(e)   # ckpt/loader.state: cannot save: the folder ckpt does not exist
    """

    def __init__(self, message: str, path: str = "", errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno  # set after OSError.__init__: str(self) stays the message

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.path, self.errno))


class ConfigMismatchError(SavableLoaderError):
    """A restore under a configuration the loader cannot honour.

    ``field`` names the configuration entry, ``saved`` is its value in the state and
    ``current`` its value in the loader being restored.

    Example::

        try:
            loader.restore_state_rank(state)
        except ConfigMismatchError as e:
            print(e.field, e.saved, e.current)   # e.g. seed 7 8
    """

    def __init__(self, field: str, saved: Any, current: Any, hint: str = "") -> None:
        self.field = field
        self.saved = saved
        self.current = current
        self.hint = hint
        message = f"cannot restore: {field} was {saved!r} when the state was saved, but is {current!r} now"
        if hint:
            message += f" ({hint})"
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.field, self.saved, self.current, self.hint))


class LoaderUsageError(SavableLoaderError, ValueError):
    """An argument or a call sequence the loader does not support.

    Also a ``ValueError``. Example::

        SavableDataLoader(dataset, sampler=my_sampler)   # LoaderUsageError: says why and what to use
    """


class UsageTypeError(LoaderUsageError, TypeError):
    """An argument of the wrong type (a function expected, a value that has no plain
    form), or ``len()`` of something that has none. Also a ``TypeError``, as Python's.

    Example::

        sl.wrappers.MapDataset(source, fn=3)   # UsageTypeError: MapDataset fn must be callable, got 3
    """


class DatasetContractError(LoaderUsageError, NotImplementedError):
    """A :class:`~savable_loader.SavableDataset` breaks its contract in a way that would
    make a resume silently wrong; checked at the first save of each class.

    Also a ``NotImplementedError`` (a subclass that does not implement ``__iter__`` or
    ``config()`` raises it). Example: a wrapper holds its inner dataset but
    ``children()`` does not return it::

        class Bad(sl.SavableDataset):
            def __init__(self, inner):
                super().__init__(inner.worker_config)
                self.inner = inner          # children() returns () : DatasetContractError at the first save
    """


class UnsavedRngWarning(UserWarning):
    """A :class:`~savable_loader.SavableDataset` holds a random generator that is not
    listed in ``_savable_fields``: its draws will not resume exactly. Given once per
    class and process, at its first save.

    Example::

        class Noisy(sl.SavableDataset):
            _savable_fields = ("pos",)     # self.rng is missing: UnsavedRngWarning
    """


class RestoreKeyError(SavableLoaderError, ValueError):
    """A restore key cannot be turned back into its batch.

    The key is malformed, was made by a loader with another seed or dataset, or the
    pipeline holds a dataset that cannot rebuild samples (``can_restore_sample()`` is
    False; the message gives the reason).

    Example::

        try:
            batch = loader.restore_sample(RestoreKey.parse(line))
        except RestoreKeyError as e:
            print(e)
    """


class DataError(SavableLoaderError, ValueError):
    """The data a source reads is malformed: missing or invalid shard metadata, a shard
    whose length disagrees with it, an unreadable shard, a line that is not JSON.

    The message names the file (and the field or line).

    Also a ``ValueError``. Example::

        try:
            batch = next(it)
        except DataError as e:
            print(e)   # names the shard file and what is wrong with it
    """


class ResumeMismatchError(SavableLoaderError, AssertionError):
    """:func:`savable_loader.testing.check_resume` found a resumed run that differs from
    the uninterrupted one; the message names the save point and the first differing item.

    Also an ``AssertionError``, so test runners report it as a failed check. Example::

        try:
            check_resume(factory)
        except ResumeMismatchError as e:
            print(e)   # save at step 3 (live, after epoch 0, item 2): the resumed run: item 5 ... differs: ...
    """


class InternalError(SavableLoaderError, RuntimeError):
    """An invariant of savable_loader itself does not hold: a bug in the library, not in
    the caller's code. The message says which invariant; please report it.

    Also a ``RuntimeError``. Example::

        raise InternalError("worker 2 sent sample 7 after its end marker")
    """


class WorkerError(SavableLoaderError, RuntimeError):
    """A worker process failed; ``worker_id`` is its logical id within this rank.

    Also a ``RuntimeError``. Example::

        try:
            batch = next(it)
        except WorkerError as e:
            print(f"worker {e.worker_id} failed: {e}")
    """

    def __init__(self, message: str, worker_id: int | None = None) -> None:
        self.worker_id = worker_id
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.args[0], self.worker_id))


class WorkerDiedError(WorkerError):
    """A worker process exited (killed, crashed) while the loader still needed it.

    Raised by the next loader call (``next``, ``save_state_rank``), never from a signal
    handler. Example::

        try:
            state = loader.save_state_rank()
        except WorkerDiedError as e:
            print(e.worker_id)   # the logical worker that died
    """


class WorkerTimeoutError(WorkerError):
    """A worker did not produce a sample within the loader's ``timeout=`` (a save never
    waits on a worker). Example::

        loader = SavableDataLoader(dataset, batch_size=8, num_workers=2, timeout=30)
    """
