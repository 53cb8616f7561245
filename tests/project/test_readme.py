"""README.md stays true: CI runs its test command, and its pipeline example works."""

from __future__ import annotations

import io
import random
import re
import subprocess
from pathlib import Path

import torch

import savable_loader as sl
from tests.common import assert_streams, check_resume_everywhere

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
USAGE = (ROOT / "docs" / "usage.md").read_text()  # the README's usage sections moved there


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", USAGE, flags=re.DOTALL)


def test_ci_runs_the_readme_test_command():
    out = subprocess.run(
        ["bash", "-c", "grep -m1 -E '^python -m pip install .*&& python -m pytest' README.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # the suite runs in one process per core (pytest-xdist, installed by the test extra)
    assert out.endswith("python -m pytest -n auto")
    assert "pytest-xdist" in (ROOT / "pyproject.toml").read_text()
    assert "grep -m1 -E '^python -m pip install .*&& python -m pytest' README.md" in (ROOT / ".ci/run").read_text()
    assert "python -m savable_loader demo" in README


def test_ci_runs_a_part_of_the_suite_under_python_O():
    ci = (ROOT / ".ci/run").read_text()
    step = next(line for line in ci.splitlines() if "python -O -m pytest" in line)
    assert "python -O -m pytest" in README
    for module in re.findall(r"tests/\S+\.py", step):
        assert (ROOT / module).is_file(), module
    assert "tests/project/test_optimize.py" in step


def test_readme_pipeline_example_runs_and_resumes():
    source_block = next(b for b in _python_blocks() if "class MySource" in b)
    pipeline_block = next(b for b in _python_blocks() if "ShuffleBufferDataset(ds, size=1000)" in b)
    namespace: dict = {"sl": sl}
    exec(source_block, namespace)
    namespace["augment"] = lambda x: x + random.random()

    def build():
        ns = {**namespace, "torch": torch}
        code = (
            pipeline_block.replace("...", "items=[torch.tensor(float(i)) for i in range(50)]")
            .replace("size=1000", "size=8")
            .replace("batch_size=32", "batch_size=4")
            .replace("num_workers=2", "num_workers=0")
        )
        exec(code, ns)
        return ns["loader"]

    first = list(build())
    assert sorted(torch.cat(first).floor().long().tolist()) == list(range(50))
    assert_streams(list(build()), first, "README pipeline, second run")
    check_resume_everywhere(build, epochs=1, steps=[0, 3, 7, 13])


def test_the_readme_progress_bar_shows_the_batches_done_of_the_epoch_after_a_restore():
    """The README's tqdm line, after a restore 8 batches into a 13-batch epoch: the bar
    runs from 8/13 to 13/13 (not 0/5 to 5/5)."""
    tqdm = __import__("pytest").importorskip("tqdm").tqdm
    (line,) = [m for m in re.findall(r"`(tqdm\(loader[^`]*)`", USAGE)]
    make = lambda: sl.SavableDataLoader(list(range(52)), batch_size=4, shuffle=True, seed=0)
    first = make()
    it = iter(first)
    for _ in range(8):
        next(it)
    loader = make()
    loader.restore_state_rank(first.save_state_rank())
    quiet = lambda *a, **k: tqdm(*a, file=io.StringIO(), **k)
    bar = eval(line, {"tqdm": quiet, "loader": loader, "len": len})
    assert (bar.n, bar.total) == (8, 13)
    assert len(list(bar)) == 5 and (bar.n, bar.total) == (13, 13)


def test_the_readme_checkpoint_example_is_the_one_docs_quickstart_runs():
    # docs/quickstart.md runs it (tests/project/test_docs.py): killed after step 35,
    # started again, it must end with the uninterrupted run's weights
    block = re.findall(r"```python\n(.*?)```", README, flags=re.DOTALL)[0]
    example = block.split('\n\nif __name__ == "__main__":', 1)[0].strip()
    assert "def train(" in example and "torch.get_rng_state()" in example
    assert example in (ROOT / "docs" / "quickstart.md").read_text()
