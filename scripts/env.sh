#!/usr/bin/env bash
# Sourced by test.sh and demo.sh: make .venv, with a torch it can see (>= 2.6) kept, or the
# CPU build torch==2.13.0 on a machine without a GPU, and funcshard installed with $EXTRAS
# (editable: this checkout's files, as they are edited).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
# editable_mode=compat: a path entry to this checkout in site-packages, which a folder named
# funcshard beside a script (a clone, say) cannot shadow; setuptools' default editable finder
# runs after the path finder, so such a folder was imported instead, as a namespace package.
"$py" -m pip install -q -e ".[${EXTRAS}]" --config-settings editable_mode=compat
