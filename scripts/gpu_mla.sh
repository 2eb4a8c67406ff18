#!/usr/bin/env bash
# One GPU call for the MLA decode kernel (cuda_src/mla_sm90): build with the
# kernels exported ahead of time into AOT_DIR (scripts/prepare_gpu_run.sh's
# layout plus lib/mla_sm90_sm_90a), the MLA GPU tests, then the benchmark
# (bfloat16 cache; BENCH_ARGS go to benchmarks/bench_mla.py). Each step has
# a time limit, so that a hang in one leaves time for the next.
#
#   OUT=DIR bash scripts/gpu_mla.sh AOT_DIR [BENCH_ARGS...]
set -uo pipefail
AOT_DIR=$(realpath "${1:?usage: gpu_mla.sh AOT_DIR [BENCH_ARGS...]}")
shift
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
bash scripts/gpu_check.sh "$AOT_DIR" none || exit 1
smoke=0
if [[ -n ${SMOKE:-} ]]; then  # a quick script first: its failure skips the benchmark
  echo "== smoke ($(date +%T))"
  timeout "${SMOKE_TIMEOUT:-90}" python3 "$SMOKE" >"$OUT/smoke.log" 2>&1
  smoke=$?
  tail -30 "$OUT/smoke.log"
fi
echo "== MLA GPU tests ($(date +%T))"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest tests/test_mla.py -k "${TESTS_K:-Gpu}" -v -n 4 \
    -p no:cacheprovider --tb=short >"$OUT/tests.log" 2>&1
echo "tests: exit $?"
grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" "$OUT/tests.log" | tail -40
echo "== MLA benchmark ($(date +%T))"
[[ $smoke == 0 ]] || { echo "skipped: the smoke script failed (exit $smoke)"; exit 1; }
timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_mla.py --kv-dtypes bfloat16 \
    --out "$OUT/bench_mla.json" "$@" 2>&1 | tee "$OUT/bench.log"
echo "== done ($(date +%T))"
