"""docs/*.md stay true: every code block runs, every link resolves.

Each page's ```python blocks run in order in one namespace (a reader copies them in
order), in a fresh temporary folder; its ```sh blocks run with bash in the same folder
after the Python blocks before them. A block that cannot run here carries a marker on the
line before it:

* ``<!-- not run: REASON -->``: installation commands and long runs covered elsewhere
  (the reason names the test that covers it, if any);
* ``<!-- requires: MODULE -->``: skipped only when MODULE cannot be imported.

```text blocks are sample output, not code.
"""

from __future__ import annotations

import importlib.util
import linecache
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"(?:<!--\s*(?P<marker>[^>]*?)\s*-->\s*\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)```", re.DOTALL)


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def _blocks(page: Path) -> list[tuple[str, str, str]]:
    """``(language, marker, body)`` of every fenced block of a page."""
    return [(m["lang"], (m["marker"] or "").strip(), m["body"]) for m in _FENCE.finditer(page.read_text())]


def _env() -> dict[str, str]:
    """sh blocks run `python`: this interpreter, importing this checkout."""
    return dict(
        os.environ,
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )


def test_docs_exist_and_readme_links_them():
    names = {p.name for p in _pages()}
    for name in (
        "index.md",
        "quickstart.md",
        "concepts.md",
        "recipes.md",
        "migration.md",
        "custom_dataset.md",
        "state_format.md",
    ):
        assert name in names
    assert "(docs/index.md)" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_links_resolve(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # an external address
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.name} links to {target}, which does not exist"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_every_block_is_run_or_says_why_not(page):
    for lang, marker, body in _blocks(page):
        if lang in ("python", "sh"):
            assert not marker or marker.startswith(("not run:", "requires:")), (page.name, marker)
            if marker.startswith("not run:"):
                assert marker[len("not run:") :].strip(), f"{page.name}: a 'not run' block needs a reason"
        else:
            assert lang == "text", f"{page.name}: block of language {lang!r} (python, sh or text)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    ran = 0
    for number, (lang, marker, body) in enumerate(_blocks(page), 1):
        if lang not in ("python", "sh") or marker.startswith("not run:"):
            continue
        if marker.startswith("requires:"):
            module = marker[len("requires:") :].strip()
            if importlib.util.find_spec(module) is None:
                continue
        where = f"{page.name}, block {number}"
        if lang == "python":
            with warnings.catch_warnings():
                # DCP says so when it saves in a single process, as the recipes do here.
                warnings.filterwarnings("ignore", message=".*assuming the intent is to")
                linecache.cache[where] = (len(body), None, body.splitlines(True), where)  # readable tracebacks
                exec(compile(body, where, "exec"), namespace)
        else:
            out = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", body],
                cwd=tmp_path,
                env=_env(),
                capture_output=True,
                text=True,
                timeout=60,
                stdin=subprocess.DEVNULL,
            )
            assert out.returncode == 0, f"{where} failed:\n{body}\n{out.stdout}\n{out.stderr}"
        ran += 1
    assert ran or not any(lang in ("python", "sh") for lang, _, _ in _blocks(page))
