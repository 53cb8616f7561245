"""Tests for savable_loader.errors: the exception tree, messages and pickling."""

from __future__ import annotations

import inspect
import pickle
import re

import cloudpickle
import pytest

import savable_loader
from savable_loader import errors
from savable_loader.errors import (
    ConfigMismatchError,
    DataError,
    DatasetContractError,
    IntegrityError,
    InternalError,
    LoaderUsageError,
    RangeIgnoredError,
    RestoreKeyError,
    ResumeMismatchError,
    SavableLoaderError,
    StateError,
    StateFileError,
    StateVersionError,
    StorageError,
    StreamTimeoutError,
    StreamTrimmedError,
    WorkerDiedError,
    WorkerError,
    WorkerTimeoutError,
)

# child -> parent, as drawn in the docstring of errors.py
TREE = {
    StateError: SavableLoaderError,
    StateVersionError: StateError,
    StateFileError: StateError,
    ConfigMismatchError: SavableLoaderError,
    LoaderUsageError: SavableLoaderError,
    DatasetContractError: LoaderUsageError,
    errors.UsageTypeError: LoaderUsageError,
    errors.UndeclaredRngError: LoaderUsageError,
    RestoreKeyError: SavableLoaderError,
    DataError: SavableLoaderError,
    ResumeMismatchError: SavableLoaderError,
    InternalError: SavableLoaderError,
    StorageError: SavableLoaderError,
    RangeIgnoredError: StorageError,
    StreamTimeoutError: SavableLoaderError,
    IntegrityError: DataError,
    StreamTrimmedError: DataError,
    WorkerError: SavableLoaderError,
    WorkerDiedError: WorkerError,
    WorkerTimeoutError: WorkerError,
}
ALL = [SavableLoaderError, *TREE]


def ancestors(cls: type) -> set[type]:
    out = set()
    while cls in TREE:
        cls = TREE[cls]
        out.add(cls)
    return out


def test_tree_matches_the_docstring_drawing() -> None:
    """Parse the drawing in errors.py's docstring: each class's parent is the nearest line above it
    that is indented less."""
    drawn: list[tuple[int, str]] = []
    for line in errors.__doc__.splitlines():
        match = re.match(r"^(\s*(?:│\s*)*(?:[├└]── )?)(\w+Error)\b", line)
        if match:
            drawn.append((len(match.group(1)), match.group(2)))
    parents: dict[str, str] = {}
    for i, (depth, name) in enumerate(drawn):
        above = [n for d, n in drawn[:i] if d < depth]
        if above:
            parents[name] = above[-1]
    assert drawn[0][1] == "SavableLoaderError"
    assert parents == {child.__name__: parent.__name__ for child, parent in TREE.items()}


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_subclass_relations(cls: type) -> None:
    assert issubclass(cls, SavableLoaderError)
    assert issubclass(cls, Exception)
    expected = ancestors(cls) | {cls}
    for other in ALL:
        assert issubclass(cls, other) == (other in expected), (cls, other)


def test_direct_parents() -> None:
    for child, parent in TREE.items():
        library_bases = [b for b in child.__bases__ if b.__module__ == errors.__name__]
        assert library_bases == [parent], child


def test_builtin_bases() -> None:
    assert issubclass(LoaderUsageError, ValueError)
    assert issubclass(DataError, ValueError) and issubclass(RestoreKeyError, ValueError)
    assert issubclass(WorkerError, RuntimeError) and issubclass(InternalError, RuntimeError)
    assert issubclass(ResumeMismatchError, AssertionError)
    assert issubclass(errors.UsageTypeError, TypeError) and issubclass(DatasetContractError, NotImplementedError)
    assert issubclass(errors.UnsavedRngWarning, UserWarning)
    assert issubclass(WorkerDiedError, RuntimeError) and issubclass(WorkerTimeoutError, RuntimeError)
    assert not issubclass(StateError, ValueError)
    assert issubclass(StateFileError, OSError) and not issubclass(StateError, OSError)
    assert not issubclass(ConfigMismatchError, (ValueError, RuntimeError))
    # not an OSError: torch's worker-failure translation treats a bare OSError as a dead worker
    assert not issubclass(StorageError, (OSError, ValueError, RuntimeError))
    assert issubclass(IntegrityError, ValueError) and not issubclass(IntegrityError, StorageError)


# The errors users catch: also at the top level (docs/concepts.md, "Errors").
TOP_LEVEL = {ConfigMismatchError, DataError, LoaderUsageError, SavableLoaderError, StateError, WorkerError}


def test_all_exports_and_top_level_names() -> None:
    defined = [
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ]
    assert errors.__all__ == sorted(defined), "errors.__all__ lists every exception errors.py defines, sorted"
    assert sorted(errors.__all__) == sorted([c.__name__ for c in ALL] + ["UnsavedRngWarning"])
    for cls in [*ALL, errors.UnsavedRngWarning]:
        if cls in TOP_LEVEL:
            assert getattr(savable_loader, cls.__name__) is cls
        else:
            assert not hasattr(savable_loader, cls.__name__), f"{cls.__name__} lives in savable_loader.errors only"


def test_base_catches_everything() -> None:
    raised = [
        StateError("s"),
        StateVersionError("v"),
        ConfigMismatchError("f", 1, 2),
        LoaderUsageError("u"),
        WorkerError("w", 1),
        WorkerDiedError("d", 2),
        WorkerTimeoutError("t", 3),
        StorageError("s"),
        RangeIgnoredError("r"),
        IntegrityError("i"),
    ]
    for exc in raised:
        with pytest.raises(SavableLoaderError):
            raise exc


# -- ConfigMismatchError ----------------------------------------------------------------


def test_config_mismatch_message_names_field_saved_and_current() -> None:
    e = ConfigMismatchError("num_workers", 4, 2)
    assert (e.field, e.saved, e.current, e.hint) == ("num_workers", 4, 2, "")
    assert str(e) == "cannot restore: num_workers was 4 when the state was saved, but is 2 now"


def test_config_mismatch_message_uses_repr_and_hint() -> None:
    e = ConfigMismatchError("dataset_fingerprint", "abc", "def", hint="the dataset configuration changed")
    assert str(e) == (
        "cannot restore: dataset_fingerprint was 'abc' when the state was saved, but is 'def' now "
        "(the dataset configuration changed)"
    )
    assert e.hint == "the dataset configuration changed"
    nested = ConfigMismatchError("dataset_config", {"n": 10}, {"n": 12})
    assert "{'n': 10}" in str(nested) and "{'n': 12}" in str(nested)
    none = ConfigMismatchError("batch_size", None, 8)
    assert "batch_size was None" in str(none) and "is 8 now" in str(none)


# -- pickling ---------------------------------------------------------------------------


def _round_trips(exc: BaseException) -> list[BaseException]:
    return [pickle.loads(pickle.dumps(exc, protocol=p)) for p in range(2, pickle.HIGHEST_PROTOCOL + 1)] + [
        pickle.loads(cloudpickle.dumps(exc))
    ]


@pytest.mark.parametrize(
    "exc",
    [
        SavableLoaderError("base"),
        StateError("bad state"),
        StateVersionError("upgrade savable-loader"),
        LoaderUsageError("bad call"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_simple_errors_survive_pickling(exc: BaseException) -> None:
    for back in _round_trips(exc):
        assert type(back) is type(exc)
        assert str(back) == str(exc)
        assert back.args == exc.args


@pytest.mark.parametrize("hint", ["", "use the same num_workers"])
def test_config_mismatch_survives_pickling(hint: str) -> None:
    exc = ConfigMismatchError("world_size", 8, 4, hint=hint)
    for back in _round_trips(exc):
        assert type(back) is ConfigMismatchError
        assert (back.field, back.saved, back.current, back.hint) == ("world_size", 8, 4, hint)
        assert str(back) == str(exc)


def test_config_mismatch_with_container_values_survives_pickling() -> None:
    exc = ConfigMismatchError("dataset_config", {"n": [1, 2]}, {"n": [1, 3]}, "x")
    back = pickle.loads(pickle.dumps(exc))
    assert back.saved == {"n": [1, 2]} and back.current == {"n": [1, 3]}
    assert str(back) == str(exc)


@pytest.mark.parametrize("cls", [WorkerError, WorkerDiedError, WorkerTimeoutError], ids=lambda c: c.__name__)
@pytest.mark.parametrize("worker_id", [None, 0, 3])
def test_worker_errors_survive_pickling(cls: type[WorkerError], worker_id: int | None) -> None:
    exc = cls(f"worker {worker_id} exited with code -9", worker_id=worker_id)
    assert exc.worker_id == worker_id
    assert str(exc) == f"worker {worker_id} exited with code -9"
    for back in _round_trips(exc):
        assert type(back) is cls
        assert back.worker_id == worker_id
        assert str(back) == str(exc)


@pytest.mark.parametrize("errno", [None, 2])
def test_state_file_error_keeps_path_errno_and_message(errno: int | None) -> None:
    exc = StateFileError("ckpt/x.state: cannot save: the folder ckpt does not exist", "ckpt/x.state", errno)
    for candidate in [exc, *_round_trips(exc)]:
        assert type(candidate) is StateFileError
        assert (candidate.path, candidate.errno) == ("ckpt/x.state", errno)
        assert str(candidate) == "ckpt/x.state: cannot save: the folder ckpt does not exist"  # not "[Errno 2] ..."


def test_worker_error_default_worker_id() -> None:
    exc = WorkerTimeoutError("no answer within 30 s")
    assert exc.worker_id is None
    assert pickle.loads(pickle.dumps(exc)).worker_id is None


# -- storage errors -----------------------------------------------------------------------


def test_storage_error_keeps_its_fields_through_pickling() -> None:
    exc = StorageError("s3://b/x bytes [0, 10): 3 attempts ...", "s3://b/x", (0, 10), 3, "HTTP 503 (...)")
    for candidate in [exc, *_round_trips(exc)]:
        assert type(candidate) is StorageError
        assert (candidate.url, candidate.byte_range, candidate.attempts, candidate.cause) == (
            "s3://b/x",
            (0, 10),
            3,
            "HTTP 503 (...)",
        )
        assert str(candidate) == "s3://b/x bytes [0, 10): 3 attempts ..."
    ranged = RangeIgnoredError("http://h/x bytes [5, 10): ...", "http://h/x", (5, 10), 1, "30 bytes")
    back = pickle.loads(pickle.dumps(ranged))
    assert type(back) is RangeIgnoredError and back.byte_range == (5, 10)
    integrity = IntegrityError("s3://b/x: the metadata says 10 bytes, the file has 12", "s3://b/x", "size", 10, 12)
    for candidate in [integrity, *_round_trips(integrity)]:
        assert type(candidate) is IntegrityError
        assert (candidate.url, candidate.field, candidate.expected, candidate.found) == ("s3://b/x", "size", 10, 12)


def test_stream_timeout_error_keeps_its_fields_through_pickling() -> None:
    exc = StreamTimeoutError("rank 1 waited 2.0 s for index 7", 1, 7, 2.0)
    for candidate in [exc, *_round_trips(exc)]:
        assert type(candidate) is StreamTimeoutError
        assert (candidate.rank, candidate.position, candidate.waited) == (1, 7, 2.0)
        assert str(candidate) == "rank 1 waited 2.0 s for index 7"
    assert isinstance(exc, TimeoutError)


@pytest.mark.parametrize(
    "cls", [StorageError, RangeIgnoredError, IntegrityError, StreamTimeoutError], ids=lambda c: c.__name__
)
def test_storage_errors_survive_torch_worker_reraise(cls: type[Exception]) -> None:
    """A worker's exception reaches the main process as ``exc_type(text)`` (torch's
    ExceptionWrapper): the class and the message must survive."""
    from torch._utils import ExceptionWrapper

    try:
        raise cls("s3://bucket/train/shard-00007.tar bytes [0, 16): 8 attempts in 41.3 s failed")
    except cls:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 1")
    with pytest.raises(cls) as info:
        wrapper.reraise()
    assert "s3://bucket/train/shard-00007.tar bytes [0, 16): 8 attempts" in str(info.value)
    assert "worker process 1" in str(info.value)
