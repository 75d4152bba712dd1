#!/usr/bin/env bash
# The one test command: installs what is missing into .venv, then runs ruff, the import
# contracts, the type checker, the docs site's strict build and the suite.
#   bash scripts/test.sh [--quick] [extra pytest args]
# --quick, first if given: the quick lane for iteration, the same checks before the suite,
# then only the tests marked `quick` (pytest -m quick: one or two core parity tests a wing,
# chosen by what they guard). CI (.ci/run) never passes it: it runs the whole suite.
# The tests run in pytest-xdist workers, one a core (at most 4: each starts its own rank pools),
# a test file to a worker (its module-scoped fixtures are computed once); FUNCSHARD_TEST_WORKERS
# sets the count (0: in this process, as plain pytest does).
set -euo pipefail
# Byte-code caches on: where PYTHONDONTWRITEBYTECODE is set (this VM's default), every Python
# the suite starts (xdist workers, rank pools' forkservers, the docs' scripts, torchrun ranks)
# would compile funcshard and the tests anew, about 0.5 s of CPU each.
unset PYTHONDONTWRITEBYTECODE
lane=()
if [ "${1:-}" = --quick ]; then
  shift
  lane=(-m quick)
fi
EXTRAS=test,docs source "$(dirname "$0")/env.sh"
"$py" -m ruff check .
.venv/bin/lint-imports  # the wings' layers (pyproject.toml [tool.importlinter])
"$py" -m mypy  # types, at mypy's standard strictness (pyproject.toml [tool.mypy])
# The docs site (mkdocs.yml) into site/: a broken link, a page missing from the nav or an API
# name that no longer resolves is a warning, and --strict makes it fail.
echo "mkdocs build --strict"
NO_MKDOCS_2_WARNING=1 "$py" -m mkdocs build --strict --site-dir site
workers=(-n "${FUNCSHARD_TEST_WORKERS:-auto}" --maxprocesses 4 --dist loadfile)
"$py" -m pytest "${workers[@]}" ${lane[@]+"${lane[@]}"} "$@"
