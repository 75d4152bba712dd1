#!/usr/bin/env bash
# The one test command: installs what is missing into .venv, then runs ruff, the import
# contracts, the type checker and the suite.
#   bash scripts/test.sh [extra pytest args]
set -euo pipefail
EXTRAS=test source "$(dirname "$0")/env.sh"
"$py" -m ruff check .
.venv/bin/lint-imports  # the wings' layers (pyproject.toml [tool.importlinter])
"$py" -m mypy  # types, at mypy's standard strictness (pyproject.toml [tool.mypy])
"$py" -m pytest "$@"
