"""A saved dataset configuration against the current one: the first difference, named.

Example::

    check_dataset_config(saved_config, current_config)   # ConfigMismatchError at the first difference
"""

from __future__ import annotations

import re
from typing import Any

from savable_loader.dataset.base import config_fingerprint, current_names
from savable_loader.errors import ConfigMismatchError
from savable_loader.state.schema import LoaderConfig

__all__ = ["check_dataset_config"]


def check_dataset_config(saved: LoaderConfig, current: LoaderConfig) -> None:
    """ConfigMismatchError naming the first differing entry of the dataset configs."""
    if saved.dataset_fingerprint == current.dataset_fingerprint:
        return
    renamed = current_names(saved.dataset_config)  # classes saved under earlier names
    if config_fingerprint(renamed) == current.dataset_fingerprint:
        return
    path, old, new = _first_difference(saved.dataset_config, current.dataset_config, "dataset_config")
    raise ConfigMismatchError(path, old, new, "the dataset changed since the state was saved" + _moved_hint(old, new))


_CLASS_NAME = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+")


def _moved_hint(old: Any, new: Any) -> str:
    """The way out when a class name differs only by its module (a class moved, e.g. out
    of ``__main__``): the documented ``__savable_aliases__``."""
    if not (
        isinstance(old, str) and isinstance(new, str) and _CLASS_NAME.fullmatch(old) and _CLASS_NAME.fullmatch(new)
    ):
        return ""
    if old.rsplit(".", 1)[-1] != new.rsplit(".", 1)[-1]:
        return ""
    cls = new.rsplit(".", 1)[-1]
    return (
        f"; if only the class moved (the same data), declare __savable_aliases__ = ({old!r},) in class {cls} "
        f"(or a name that survives moves: __savable_name__ = {cls.lower()!r}), see docs/custom_dataset.md"
    )


def _first_difference(old: Any, new: Any, path: str) -> tuple[str, Any, Any]:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            if old.get(key, "<missing>") != new.get(key, "<missing>"):
                return _first_difference(old.get(key, "<missing>"), new.get(key, "<missing>"), f"{path}.{key}")
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        for i, (a, b) in enumerate(zip(old, new)):
            if a != b:
                return _first_difference(a, b, f"{path}[{i}]")
    return path, old, new
