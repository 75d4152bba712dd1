#!/usr/bin/env bash
# The one test command: installs what is missing into .venv, then runs ruff and the whole suite.
#   bash scripts/test.sh [extra pytest args]
# A torch the venv can already see (>= 2.6) is kept; otherwise a CPU-only machine gets
# torch==2.13.0 (a CPU build) instead of a multi-GB CUDA download.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv --system-site-packages .venv
fi
py=.venv/bin/python

have_torch=$("$py" - <<'PY'
try:
    import torch
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    print("yes" if (major, minor) >= (2, 6) else "no")
except Exception:
    print("no")
PY
)
if [ "$have_torch" != yes ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$py" -m pip install -q torch
  else
    "$py" -m pip install -q torch==2.13.0
  fi
fi
"$py" -m pip install -q -e ".[test]"

"$py" -m ruff check .
"$py" -m pytest "$@"
