"""savable_loader.integrations: importing savable_loader (all of its public names, the
integrations package included) imports no training framework."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "accelerate", "transformers", "datasets")


def test_importing_savable_loader_imports_no_framework():
    code = (
        "import sys, savable_loader as sl, savable_loader.integrations\n"
        "for name in sl.__all__: getattr(sl, name)\n"
        "import savable_loader.loader, savable_loader.distributed\n"
        f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
