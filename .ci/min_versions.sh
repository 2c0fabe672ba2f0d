#!/usr/bin/env bash
# The fast tests on the lowest versions pyproject.toml allows for the light packages (.ci/constraints-min.txt).
# A throw-away venv with --system-site-packages reuses the installed torch and torchvision (never
# reinstalled, nothing large downloaded); pip installs only the pinned light packages into it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m venv --system-site-packages "$tmp/venv"
py="$tmp/venv/bin/python"
echo "min-versions: installing .ci/constraints-min.txt into $tmp/venv (torch from the system)"
"$py" -m pip install -q --disable-pip-version-check -c .ci/constraints-min.txt -e '.[test]'
# The venv must really hold the pinned versions (not the system's newer ones).
"$py" - .ci/constraints-min.txt <<'PY'
import sys
from importlib.metadata import version
pins = [line.split("#")[0].strip() for line in open(sys.argv[1])]
pins = [p.split("==") for p in pins if p]
wrong = [f"{name} {version(name)} (want {want})" for name, want in pins if version(name) != want]
if wrong:
    sys.exit("min-versions: FAILED: not the pinned versions: " + ", ".join(wrong))
import torch
print("min-versions: " + ", ".join(f"{n}=={v}" for n, v in pins) + f"; torch {torch.__version__}")
PY
# the lowest ruff the test extra allows agrees with the style .ci/run checked
"$tmp/venv/bin/ruff" check -q . && "$tmp/venv/bin/ruff" format --check -q .
export PATH="$tmp/venv/bin:$PATH" PYTHONPATH="$PWD"  # launch.sh's python3 and accelerate are the venv's too
# The fast subset, plus one single-process run to the end (export, EMA, tensorboard, curves, predict):
# the fast subset alone never reaches the end of a training run, where the accelerate bound matters.
"$py" -m pytest -q -p no:cacheprovider -m "not slow"
"$py" -m pytest -q -p no:cacheprovider tests/test_outputs.py -k "tensorboard or curves or predict"
echo "min-versions: ok in $((SECONDS - start)) s"
