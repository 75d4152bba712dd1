#!/usr/bin/env bash
# The soak and chaos tests and the recipe property test (HYPOTHESIS_PROFILE=long: 200
# drawn combinations of features), N times, with K CPU-bound hog processes beside them: a
# line per repetition (pass or fail, seconds), then a summary. Not part of CI (it takes N x
# minutes). A crashed rank fails its repetition: the suite's rerun of such tests is off here.
#   bash scripts/stress.sh [N=10] [K=2] [pytest args, default: the tests above]
set -uo pipefail
cd "$(dirname "$0")/.."
n=${1:-10}
k=${2:-2}
shift $(( $# < 2 ? $# : 2 ))
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(tests/recipes/test_soak.py tests/comm/test_chaos.py property_tests/recipes/test_recipes_props.py)
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-long}
EXTRAS=test source scripts/env.sh
hogs=()
for _ in $(seq 1 "$k"); do
  "$py" -c 'while True: pass' &
  hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null' EXIT
echo "stress: ${tests[*]}, $n repetitions, $k CPU hogs, $(nproc) cores"
failed=0
for i in $(seq 1 "$n"); do
  start=$(date +%s)
  log=$(mktemp)
  if "$py" -m pytest -q -p no:cacheprovider -p no:rerunfailures "${tests[@]}" >"$log" 2>&1; then
    result=pass
  else
    result="FAIL (log kept: $log)"
    failed=$((failed + 1))
  fi
  echo "repetition $i: $result in $(( $(date +%s) - start )) s: $(tail -n 1 "$log")"
  [ "$result" = pass ] && rm -f "$log"
done
echo "stress: $failed of $n repetitions failed"
[ "$failed" -eq 0 ]
