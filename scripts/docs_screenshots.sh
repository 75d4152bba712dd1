#!/usr/bin/env bash
# Looks at the built docs site in a real browser: installs Debian's chromium if it is
# missing, builds the site (scripts/docs.sh), serves it on localhost and renders the home
# page, one guide and one API page in headless Chromium to PNG files.
#   bash scripts/docs_screenshots.sh [OUTPUT_DIR]     (default /tmp/funcshard-docs-shots)
# SITE=dir serves a site built already instead of building one.
set -euo pipefail
out=$(realpath -m "${1:-/tmp/funcshard-docs-shots}")
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
if ! command -v chromium >/dev/null 2>&1; then
  sudo=$([ "$(id -u)" = 0 ] || echo sudo)
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq chromium >/dev/null
fi
site=${SITE:-}
if [ -z "$site" ]; then
  bash "$root/scripts/docs.sh"
  site=$root/site
fi
port=${PORT:-8765}
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$site" >/dev/null 2>&1 &
server=$!
profile=$(mktemp -d)
trap 'kill "$server" 2>/dev/null || true; rm -rf "$profile"' EXIT
for _ in $(seq 50); do  # until the server answers
  python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/')" \
    2>/dev/null && break
  sleep 0.1
done
shoot() {  # shoot NAME PATH: the page at PATH to $out/NAME.png
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$profile" --hide-scrollbars --window-size=1280,900 \
    --screenshot="$out/$1.png" "http://127.0.0.1:$port/$2" 2>/dev/null
  echo "$out/$1.png"
}
shoot home ""
shoot guide-training-step guides/training-step/
shoot api-step api/step/
