"""What a dataset's code reaches besides its attributes: module globals its methods read,
and a function's closure cells and default arguments.

A map-style dataset often draws from a generator that is not one of its attributes::

    RNG = np.random.default_rng(0)              # a module global read by __getitem__

    def noise():
        rng = np.random.default_rng(0)
        return lambda x: x + rng.random()        # a generator in a closure

    def jitter(x, rng=np.random.default_rng(0)): # a default argument
        ...

:func:`code_children` gives the objects such code refers to, so that
``rng.owned.find_generators`` finds (and the loader re-seeds) these generators too:

* for an object of a class of the user's code (not an installed library's, nor one of
  :data:`LIBRARIES`), the module globals its methods (functions, static and class methods, property
  getters, and the functions and comprehensions nested in them) read by name
  (``code.co_names``), each as ``path<global NAME>``;
* for a function (a lambda, a closure, a module function a method calls), its closure
  cells (``path<closure NAME>``), default arguments (``path<default I>``,
  ``path<kwdefault NAME>``) and the globals it reads.

Only public attributes of functions and code objects are read (``__closure__``,
``__defaults__``, ``__globals__``, ``co_names``, ``co_consts``), never a frame or a stack.
A name read as an attribute (``self.rng.integers``: ``integers``) is in ``co_names``
too; it counts only where a module global of that name exists.

Example::

    list(code_children("dataset", ds, {}))   # [("dataset<global RNG>", <Generator>), ...]
"""

from __future__ import annotations

import functools
import os
import site
import sys
import sysconfig
import types
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["LIBRARIES", "code_children", "is_user_function"]

#: Top-level packages whose code is never read (besides every module installed in the
#: Python installation's library folders: site-packages and the standard library).
LIBRARIES = ("builtins", "torch", "numpy", "savable_loader")

_LIBRARY_DIRS = tuple(
    os.path.realpath(p)
    for p in {*(sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")), *site.PREFIXES}
    if p
)
_READS: weakref.WeakKeyDictionary[type, list[tuple[str, dict[str, Any]]]] = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=4096)
def _is_library(module: Any) -> bool:
    """True for a module of a library: listed in :data:`LIBRARIES`, installed (its file
    is under site-packages or the standard library) or without a file (built in); the
    user's code (``__main__``, a script's modules, a package installed editable) is not."""
    if not isinstance(module, str):
        return True
    if module in ("__main__", "__mp_main__"):
        return False
    if module.split(".", 1)[0] in LIBRARIES:
        return True
    file = getattr(sys.modules.get(module), "__file__", None)
    if not isinstance(file, str):
        return True
    where = os.path.realpath(file)
    return any(where.startswith(d + os.sep) for d in _LIBRARY_DIRS)


def is_user_function(obj: Any) -> bool:
    """True for a Python function of the user's code (see :func:`_is_library`): its code is read."""
    try:
        return isinstance(obj, types.FunctionType) and not _is_library(getattr(obj, "__module__", None))
    except ReferenceError:  # a dead weak proxy
        return False


@functools.lru_cache(maxsize=4096)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` and the code nested in it (functions, lambdas, comprehensions) read."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_names(const))
    return tuple(dict.fromkeys(names))


def _reads(fn: types.FunctionType) -> list[tuple[str, dict[str, Any]]]:
    """``(name, globals)`` of the module globals ``fn`` may read."""
    scope = fn.__globals__
    return [(name, scope) for name in _names(fn.__code__) if name in scope]


def _class_reads(cls: type) -> list[tuple[str, dict[str, Any]]]:
    """The module globals the methods of ``cls`` (and of its bases in the user's code)
    may read; computed once per class."""
    try:
        found = _READS.get(cls)
    except TypeError:  # a class that cannot be weakly referenced
        found = None
    if found is not None:
        return found
    pairs = []
    for c in cls.__mro__:
        if _is_library(getattr(c, "__module__", None)):
            continue
        for value in list(vars(c).values()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            elif isinstance(value, property):
                value = value.fget
            if isinstance(value, types.FunctionType):
                pairs.extend(_reads(value))
    seen: set[tuple[str, int]] = set()
    found = []
    for name, scope in pairs:
        if (name, id(scope)) not in seen:
            seen.add((name, id(scope)))
            found.append((name, scope))
    try:
        _READS[cls] = found
    except TypeError:
        pass
    return found


def code_children(path: str, obj: Any) -> Iterator[tuple[str, Any]]:
    """``(path, object)`` of what ``obj``'s code refers to (see the module docstring)."""
    if isinstance(obj, types.FunctionType):
        if not is_user_function(obj):
            return
        names = obj.__code__.co_freevars
        for i, cell in enumerate(obj.__closure__ or ()):
            try:
                yield f"{path}<closure {names[i]}>", cell.cell_contents
            except ValueError:  # an empty cell
                continue
        for i, value in enumerate(obj.__defaults__ or ()):
            yield f"{path}<default {i}>", value
        for key, value in (obj.__kwdefaults__ or {}).items():
            yield f"{path}<kwdefault {key}>", value
        reads = _reads(obj)
    else:
        reads = _class_reads(type(obj))
    for name, scope in reads:
        value = scope.get(name)
        if value is not None and not isinstance(value, (types.ModuleType, type)):
            yield f"{path}<global {name}>", value
