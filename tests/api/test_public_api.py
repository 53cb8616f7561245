"""The public API is curated and documented: the top level holds what a user types, every
other name lives in its package; each ``__all__`` is sorted and holds only public things; a
docstring with an example for every exported class and function, a docstring for every
public method."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import pytest

import savable_loader as sl

PUBLIC_MODULES = [
    "savable_loader",
    "savable_loader.errors",
    "savable_loader.integrations",
    "savable_loader.rng",
    "savable_loader.sources",
    "savable_loader.state",
    "savable_loader.storage",
    "savable_loader.testing",
    "savable_loader.wrappers",
]

# What a user types: the loader, the pipeline base, the worker configuration, the base
# error and the errors users catch (docs/concepts.md, "Errors"), the version, the packages.
TOP_LEVEL = [
    "ConfigMismatchError",
    "DataError",
    "LoaderUsageError",
    "SavableDataLoader",
    "SavableDataset",
    "SavableLoaderError",
    "StateError",
    "WorkerConfig",
    "WorkerError",
    "__version__",
    "errors",
    "rng",
    "sources",
    "state",
    "stats",
    "storage",
    "testing",
    "wrappers",
]

# Public packages added to the top level since it was curated.
ADDED = {"stats"}

# Names the top level held before it was curated, and the package each lives in now.
MOVED = {
    "DatasetContractError": "savable_loader.errors",
    "IntegrityError": "savable_loader.errors",
    "InternalError": "savable_loader.errors",
    "RangeIgnoredError": "savable_loader.errors",
    "RestoreKey": "savable_loader.state",
    "RestoreKeyError": "savable_loader.errors",
    "ResumeMismatchError": "savable_loader.errors",
    "StateFileError": "savable_loader.errors",
    "StateVersionError": "savable_loader.errors",
    "StorageError": "savable_loader.errors",
    "StreamTimeoutError": "savable_loader.errors",
    "StreamTrimmedError": "savable_loader.errors",
    "UndeclaredRngError": "savable_loader.errors",
    "UnsavedRngWarning": "savable_loader.errors",
    "UsageTypeError": "savable_loader.errors",
    "WorkerDiedError": "savable_loader.errors",
    "WorkerTimeoutError": "savable_loader.errors",
}

# The packages whose faces hold only their own public things (each name has one home).
PACKAGES = [name for name in PUBLIC_MODULES if name not in ("savable_loader", "savable_loader.testing")]

# Exported names allowed to lack an "Example" (none today; the test fails on stale entries).
MISSING_EXAMPLE_ALLOWED: set[str] = set()

# Public methods allowed to lack a docstring (none today).
MISSING_METHOD_DOC_ALLOWED: set[str] = set()


def _own_doc(obj: Any) -> str:
    """The object's own docstring (a class does not inherit its base's here)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return doc or ""


def _exported() -> list[tuple[str, Any]]:
    out = []
    for name in PUBLIC_MODULES:
        module = importlib.import_module(name)
        out += [(f"{name}.{attr}", getattr(module, attr)) for attr in module.__all__]
    return out


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_all_is_sorted_and_resolves(module_name):
    module = importlib.import_module(module_name)
    assert module.__all__ == sorted(module.__all__), f"{module_name}.__all__ is not sorted"
    assert len(set(module.__all__)) == len(module.__all__)
    for name in module.__all__:
        assert hasattr(module, name), f"{module_name}.__all__ lists {name}, which does not exist"
    assert _own_doc(module).strip(), f"{module_name} has no module docstring"


def _missing_docs(exported: list[tuple[str, Any]]) -> tuple[list[str], list[str]]:
    """Exported classes, functions and modules without a docstring, and without an example."""
    missing_doc, missing_example = [], []
    for qualname, obj in exported:
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj)):
            continue  # constants: __version__, SCHEMA_VERSION (documented where defined)
        doc = _own_doc(obj)
        if not doc.strip():
            missing_doc.append(qualname)
        elif "Example" not in doc and qualname not in MISSING_EXAMPLE_ALLOWED:
            missing_example.append(qualname)
    return missing_doc, missing_example


def test_every_exported_name_has_a_docstring_with_an_example():
    missing_doc, missing_example = _missing_docs(_exported())
    assert not missing_doc, f"no docstring: {missing_doc}"
    assert not missing_example, f"docstring without an 'Example': {missing_example}"


def test_the_docstring_check_finds_what_it_looks_for():
    class Bare:
        pass

    class Terse:
        """Documented, no example."""

    def documented():
        """Has one.

        Example::

            documented()
        """

    found = _missing_docs([("m.Bare", Bare), ("m.Terse", Terse), ("m.documented", documented), ("m.N", 3)])
    assert found == (["m.Bare"], ["m.Terse"])


def test_allow_lists_name_exported_names_that_still_need_them():
    exported = dict(_exported())
    for qualname in sorted(MISSING_EXAMPLE_ALLOWED):
        assert qualname in exported, f"{qualname} is not exported any more: drop it from MISSING_EXAMPLE_ALLOWED"
        assert "Example" not in _own_doc(exported[qualname]), f"{qualname} has an example now: drop it from the list"
    for name in sorted(MISSING_METHOD_DOC_ALLOWED):
        owner, _, attr = name.rpartition(".")
        assert owner in exported and attr in vars(exported[owner]), f"{name} does not exist: drop it from the list"


def test_public_methods_have_docstrings():
    missing = []
    for qualname, obj in _exported():
        if not inspect.isclass(obj) or not obj.__module__.startswith("savable_loader"):
            continue
        for attr, value in vars(obj).items():
            if attr.startswith("_"):
                continue
            func = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if not inspect.isfunction(func):
                continue
            if not (func.__doc__ or "").strip() and not _documented_in_base(obj, attr):
                name = f"{qualname}.{attr}"
                if name not in MISSING_METHOD_DOC_ALLOWED:
                    missing.append(name)
    assert not missing, f"public methods without a docstring: {missing}"


def _documented_in_base(cls: type, attr: str) -> bool:
    """An override of a documented base method (``config``, ``children``, ...) is fine."""
    for base in cls.__mro__[1:]:
        value = base.__dict__.get(attr)
        if value is not None and (getattr(value, "__doc__", None) or "").strip():
            return True
    return False


def test_the_top_level_holds_what_a_user_types():
    assert sl.__all__ == TOP_LEVEL == sorted(TOP_LEVEL)
    assert len(set(TOP_LEVEL) - ADDED) + len(MOVED) == 34, "the 34 names of the old face, each kept or moved"


@pytest.mark.parametrize("name", TOP_LEVEL)
def test_every_top_level_name_imports(name):
    namespace: dict[str, Any] = {}
    exec(f"from savable_loader import {name}", namespace)
    assert namespace[name] is getattr(sl, name)


def test_the_lazy_map_names_exactly_the_face():
    """No hidden fallback: the top level resolves no name that ``__all__`` does not list."""
    assert set(sl._LAZY) | sl._SUBMODULES | {"__version__"} == set(sl.__all__)


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_lives_in_its_package_only(name):
    with pytest.raises(AttributeError, match=re.escape(f"module 'savable_loader' has no attribute {name!r}")):
        getattr(sl, name)
    with pytest.raises(ImportError, match=f"cannot import name {name!r}"):
        exec(f"from savable_loader import {name}", {})
    assert name not in dir(sl)
    home = importlib.import_module(MOVED[name])
    assert name in home.__all__
    assert getattr(home, name).__name__ == name


def test_every_exception_lives_in_errors():
    """Each exception the package exports anywhere is ``savable_loader.errors``'s."""
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj) and issubclass(obj, sl.SavableLoaderError):
                assert getattr(sl.errors, name) is obj, f"{module_name}.{name}"


@pytest.mark.parametrize("module_name", PACKAGES)
def test_package_face_holds_only_public_things(module_name):
    """Public names only, no modules, each class and function defined in the package
    itself (not re-exported from another: a name has one home)."""
    module = importlib.import_module(module_name)
    for name in module.__all__:
        obj = getattr(module, name)
        assert not name.startswith("_"), f"{module_name}.__all__ lists the private name {name}"
        assert not inspect.ismodule(obj), f"{module_name}.__all__ lists the module {name}"
        if inspect.isclass(obj) or inspect.isfunction(obj):
            home = obj.__module__
            assert home == module_name or home.startswith(f"{module_name}."), f"{module_name}.{name} is {home}'s"


def test_the_face_check_finds_what_it_looks_for(monkeypatch):
    state = sl.state
    monkeypatch.setattr(state, "__all__", [*state.__all__, "schema"])
    with pytest.raises(AssertionError, match="lists the module schema"):
        test_package_face_holds_only_public_things("savable_loader.state")
    monkeypatch.setattr(state, "__all__", ["SavableDataLoader"])
    monkeypatch.setattr(state, "SavableDataLoader", sl.SavableDataLoader, raising=False)
    with pytest.raises(AssertionError, match="savable_loader.loader.dataloader's"):
        test_package_face_holds_only_public_things("savable_loader.state")
