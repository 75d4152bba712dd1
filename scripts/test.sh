#!/usr/bin/env bash
# The one test command: installs what is missing into .venv, then runs ruff and the suite.
#   bash scripts/test.sh [extra pytest args]
set -euo pipefail
EXTRAS=test source "$(dirname "$0")/env.sh"
"$py" -m ruff check .
"$py" -m pytest "$@"
