#!/usr/bin/env bash
# scripts/gloo_heap_repro.py on many cores at once: each pair of cores (taskset) runs copies
# of it one after another, 4 ranks each, half the pairs through torch's functional ops and
# half through the Work API, until SECONDS_TOTAL have passed; a line per run (ok, HUNG,
# CRASHED) and a count per API. Each pair is a loaded 2-core machine. Used on a lent
# 16-core machine for docs/guides/faults.md ("Why the soak once hung under load").
#   bash scripts/gloo_heap_pairs.sh [PAIRS=8] [SECONDS_TOTAL=320]     (logs in $OUT or out/)
set -uo pipefail
cd "$(dirname "$0")/.."
pairs=${1:-8}
total=${2:-320}
out=${OUT:-out}/gloo_heap_pairs
mkdir -p "$out"
py=$(command -v python3)
[ -x .venv/bin/python ] && py=.venv/bin/python
deadline=$(( $(date +%s) + total ))
pair() {  # pair index, api
  local p=$1 api=$2 cores="$((2 * $1)),$((2 * $1 + 1))" i=0 log="$out/pair$1-$2.log"
  while [ $(( deadline - $(date +%s) )) -ge 80 ]; do
    i=$((i + 1))
    # 30 s of collectives; the script reports a hang itself after 75 s (stacks, exit 1)
    timeout -k 5 90 taskset -c "$cores" "$py" scripts/gloo_heap_repro.py --world 4 \
      --seconds 30 --hang-after 75 --api "$api" >"$log.$i" 2>&1
    rc=$?
    if [ $rc -eq 0 ]; then r=ok; rm -f "$log.$i"
    elif grep -q "^Timeout" "$log.$i" || [ $rc -eq 124 ]; then r=HUNG
    else r="CRASHED (exit $rc)"; fi
    echo "pair $p $api run $i: $r" | tee -a "$log"
  done
}
for p in $(seq 0 $((pairs - 1))); do
  if [ $((p % 2)) -eq 0 ]; then pair "$p" functional & else pair "$p" c10d & fi
done
wait
for api in functional c10d; do
  cat "$out"/pair*-"$api".log 2>/dev/null | awk -v api="$api" '
    /: ok/ {ok++} /HUNG/ {hung++} /CRASHED/ {crashed++}
    END {printf "%s: %d ok, %d hung, %d crashed\n", api, ok, hung, crashed}'
done
