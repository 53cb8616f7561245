"""savable_loader.integrations: importing savable_loader (all of its public names, the
integrations package included) imports no training framework; frameworks that record
DataLoader arguments record the user's."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = (
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "accelerate",
    "transformers",
    "datasets",
    "tensordict",  # optional: imported only when a batch is a TensorDict
)


def test_importing_savable_loader_imports_no_framework():
    code = (
        "import sys, savable_loader as sl, savable_loader.integrations\n"
        "for name in sl.__all__: getattr(sl, name)\n"
        "import savable_loader.loader, savable_loader.distributed\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def _python(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_loader_class_exists_at_import_when_torch_is_imported():
    """Frameworks patch the DataLoader subclasses that exist when they ask for a loader;
    ``savable_loader.state`` alone still needs no torch."""
    assert _python("import torch, savable_loader as sl; print('SavableDataLoader' in vars(sl))") == "True"
    assert _python("import sys, savable_loader as sl; sl.state; print('torch' in sys.modules)") == "False"


@pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed")
def test_lightning_records_the_users_arguments():
    """Lightning rebuilds a loader from the arguments it recorded while the user's code
    built it: those must be the user's, not the loader's internal call to torch."""
    code = (
        "import lightning, torch\n"
        "import savable_loader as sl\n"
        "from lightning.fabric.utilities.data import _replace_dunder_methods\n"
        "with _replace_dunder_methods(torch.utils.data.DataLoader, 'dataset'):\n"
        "    loader = sl.SavableDataLoader(list(range(8)), batch_size=4, shuffle=True)\n"
        "print(getattr(loader, '__pl_saved_args'), getattr(loader, '__pl_saved_kwargs'))\n"
    )
    assert _python(code) == "([0, 1, 2, 3, 4, 5, 6, 7],) {'batch_size': 4, 'shuffle': True}"
