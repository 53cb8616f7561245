#!/usr/bin/env bash
# Runs savable_loader's core resume tests and its demo on a torch release you name, the
# way a user gets the package: the wheel of this checkout, built from a clean copy and
# `pip install`ed (not editable) into a venv of its own with that torch.
#
#   scripts/torch_matrix.sh 2.4.1            # the oldest supported torch
#   scripts/torch_matrix.sh 2.15.0 -x        # arguments after the version go to pytest
#
# The venv is made once per version under $SAVABLE_LOADER_MATRIX_DIR (default
# ~/.cache/savable_loader-torch-matrix/VERSION-pyX.Y) and reused; the package is reinstalled
# every run. The demo runs from outside the checkout; the tests run from a copy of tests/,
# and the script checks that they import the installed package, not the checkout's.
# Environment: PYTHON (the interpreter to make the venv with, default python3),
# TORCH_INDEX_URL (an index for torch's wheels, e.g. https://download.pytorch.org/whl/cpu;
# default: pip's own, which on Linux gives the CUDA build, about 3 GB, kept in pip's cache).
# Exit status: 0 when the demo says "identical: yes" and the tests pass.
set -euo pipefail

if [ $# -lt 1 ] || [[ "$1" == -* ]]; then
    echo "usage: $0 TORCH_VERSION [PYTEST_ARGS...]" >&2
    exit 2
fi
version=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}

# The core resume subset: needs only torch, numpy, msgspec, cloudpickle, fsspec, pytest
# (with pytest-timeout, pytest-xdist), hypothesis and psutil.
subset=(
    tests/torch_internals/test_torch_internals.py
    tests/loader/test_feeder.py
    tests/loader/test_loader_dropin.py
    tests/loader/test_loader_samplers.py
    tests/loader/test_loader_arguments.py
    tests/rng/test_owned_rng.py
    tests/rng/test_global_rngs.py
    tests/loader/test_sigchld.py
    tests/rng/test_rng_states.py
    tests/dataset/test_inline.py
    tests/sources/test_pt_layout.py
    tests/sources/test_held_file.py
    tests/loader/test_loader_stats.py
)
test_deps=(pytest pytest-timeout pytest-xdist hypothesis psutil)

# A pip constraints file of the environment (a CI machine's PIP_CONSTRAINT pinning the
# torch it carries) would hold torch at another release: this venv has its own pins.
export PIP_CONSTRAINT=/dev/null
pip_index=()
if [ -n "${TORCH_INDEX_URL:-}" ]; then
    pip_index=(--extra-index-url "$TORCH_INDEX_URL")
fi

py_tag=$("$python" -c 'import sys; print(f"py{sys.version_info[0]}.{sys.version_info[1]}")')
base=${SAVABLE_LOADER_MATRIX_DIR:-$HOME/.cache/savable_loader-torch-matrix}
venv="$base/$version-$py_tag"
case "$venv/" in
    "$root"/*) echo "the venv must be outside the checkout: $venv" >&2; exit 2 ;;
esac
if [ ! -f "$venv/.complete" ]; then
    echo "+ making $venv (torch $version)"
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q "${pip_index[@]}" "torch==$version" "${test_deps[@]}"
    touch "$venv/.complete"
fi
vpy="$venv/bin/python"

work=$(mktemp -d "${TMPDIR:-/tmp}/savable_loader-matrix.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The wheel, built from a copy of the checkout's files (tracked and new, not ignored), so
# that a stale build/ folder cannot put a file into the wheel that the checkout lacks.
"$vpy" - "$root" "$work/src" <<'EOF'
import os, shutil, subprocess, sys
root, dest = sys.argv[1], sys.argv[2]
listed = subprocess.run(
    ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
    check=True, capture_output=True,
).stdout.decode().split("\0")
for name in filter(None, listed):
    source = os.path.join(root, name)
    if os.path.isfile(source):  # (a tracked file deleted in the work tree is left out)
        os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
        shutil.copy2(source, os.path.join(dest, name))
EOF
echo "+ pip wheel --no-deps (the checkout's files)"
"$vpy" -m pip wheel -q --no-deps -w "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/savable_loader-*.whl)
echo "+ pip install $(basename "$wheel") torch==$version"
# torch==VERSION with the wheel: pip refuses if the wheel's requirements exclude that torch
"$vpy" -m pip install -q --force-reinstall --no-deps "$wheel"
"$vpy" -m pip install -q "${pip_index[@]}" "$wheel" "torch==$version" "${test_deps[@]}"

cd "$work"
installed=$("$vpy" -c 'import savable_loader, torch; print(savable_loader.__file__, torch.__version__)')
echo "+ installed: $installed"
case "$installed" in
    "$venv"/*) ;;
    *) echo "savable_loader is not imported from the venv: $installed" >&2; exit 1 ;;
esac

echo "+ (cd $work && python -m savable_loader demo)"
if ! "$vpy" -m savable_loader demo | tee "$work/demo.txt"; then
    echo "torch $version: the demo failed" >&2
    exit 1
fi
grep -qx "identical: yes" "$work/demo.txt"

# The tests from a copy of tests/ (they import tests.common ...), with the checkout's
# pytest settings; the checkout is not on the path, the installed package is imported.
mkdir -p "$work/run"
cp -r "$root/tests" "$work/run/tests"
cp "$root/pyproject.toml" "$work/run/"
cd "$work/run"
"$vpy" - <<'EOF'
import os, sys
sys.path.insert(0, os.getcwd())  # what pytest's rootdir insertion does
import savable_loader, tests.common  # noqa: F401
venv = os.path.realpath(sys.prefix)
assert os.path.realpath(savable_loader.__file__).startswith(venv + os.sep), savable_loader.__file__
EOF
echo "+ torch $version: python -m pytest ${subset[*]} $*"
"$vpy" -m pytest -q -p no:cacheprovider "${subset[@]}" "$@"
echo "torch $version: demo identical: yes; tests passed"
