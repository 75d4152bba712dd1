#!/usr/bin/env bash
# The GPU checks of issue 22 in one command, for the device machine (one CUDA GPU):
#   tests/recipes/test_gpu.py (skipped by the CPU suite), then `python -m benchmarks.gpu`.
# Writes the logs, the profiler trace and the gpu section of RESULTS.md to $OUT (out/gpu
# when unset). Wheels the machine lacks (optree) travel in .whl/ (see the device tool).
# Budget: GPU_TEST_TIMEOUT + GPU_BENCH_TIMEOUT seconds (300 + 240 by default).
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 FUNCSHARD_GPU_OUT="$OUT"
{ nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.nccl.version())"; } >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout "${GPU_TEST_TIMEOUT:-300}" python3 -m pytest -p funcshard.testing.pytest_plugin \
    -p no:cacheprovider -v -s tests/recipes/test_gpu.py ${GPU_TESTS:+-k "$GPU_TESTS"} 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}
[ -f "$OUT/trace.json" ] && gzip -f "$OUT/trace.json"
if [ "${GPU_BENCH_TIMEOUT:-240}" != 0 ]; then
    timeout "${GPU_BENCH_TIMEOUT:-240}" python3 -m benchmarks.gpu --out "$OUT" ${GPU_BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
    bench=${PIPESTATUS[0]}
else
    bench=0
fi
echo "tests rc=$tests bench rc=$bench"
exit $((tests || bench))
