#!/usr/bin/env bash
# The docs site (mkdocs.yml, docs/): installs the docs extra into .venv, then builds the site
# into site/ (open site/index.html), or with `serve` serves it with live reload.
#   bash scripts/docs.sh              build, strict: a broken link or reference fails
#   bash scripts/docs.sh serve [-a 127.0.0.1:8000]
set -euo pipefail
EXTRAS=docs source "$(dirname "$0")/env.sh"
export NO_MKDOCS_2_WARNING=1
if [ "${1:-}" = serve ]; then
  shift
  exec "$py" -m mkdocs serve "$@"
fi
"$py" -m mkdocs build --strict --site-dir site "$@"
