#!/usr/bin/env bash
# launch.sh: the one launcher for accel_train on clusters and as a ModelArts boot command
# (`./launch.sh [options] [trainer flags]`, `/bin/bash ${MA_JOB_DIR}/<dir>/launch.sh ...`; --help for all of it).
# The launcher is Python, in the package (accel_train/launcher/): this file finds the interpreter (PYTHON, else
# python3) and hands it the arguments unchanged, with this checkout first on its path.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "launch.sh: error: no Python interpreter '$PYTHON' here: set PYTHON=/path/to/the/python of the" \
    "environment accel_train is installed in" >&2
  exit 2
fi
# (this checkout's accel_train before any installed one, as for the job's own processes: the launcher's PYTHONPATH)
# LC_CTYPE as it is here ("=value", or empty when unset): under a C locale Python sets LC_CTYPE=C.UTF-8 in its own
# environment (PEP 538), which the job would inherit; the launcher puts back what the job was given
exec "$PYTHON" -c 'import os, sys
if sys.version_info < (3, 10):
    sys.stderr.write("launch.sh: error: %s is Python %d.%d; accel_train needs 3.10 or newer: activate the"
                     " environment accel_train is installed in, or set PYTHON=/path/to/its/python\n"
                     % ((sys.argv[2],) + sys.version_info[:2]))
    sys.exit(2)
if sys.argv[3]:
    os.environ["LC_CTYPE"] = sys.argv[3][1:]
else:
    os.environ.pop("LC_CTYPE", None)
sys.path.insert(0, sys.argv[1])
from accel_train.launcher.__main__ import main
sys.exit(main(sys.argv[4:], python=sys.argv[2]))' "$HERE" "$PYTHON" "${LC_CTYPE+=$LC_CTYPE}" "$@"
