#!/usr/bin/env bash
# One GPU call for the MLA decode kernels (cuda_src/mla_sm90): build with the
# kernels exported ahead of time into AOT_DIR (scripts/prepare_gpu_run.sh's
# layout plus lib/mla_sm90_sm_90a), the MLA GPU tests, then the benchmark
# (KV_DTYPES, default both caches; BENCH_ARGS go to benchmarks/bench_mla.py).
# SMOKE="script [args]" runs first (e.g. "scripts/mla_case.py --fp8": a
# kernel against the composition) and its failure skips the benchmark;
# SANITIZE_SMOKE=1 also runs it under compute-sanitizer memcheck and
# racecheck (only the MLA kernels instrumented). TESTS=0 skips the tests,
# BENCH=0 the benchmark (a 600 s call may not hold all of it).
# Each step has a time limit, so that a hang in one leaves time for the next.
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
  # shellcheck disable=SC2086  # SMOKE is a script and its arguments
  timeout "${SMOKE_TIMEOUT:-90}" python3 $SMOKE >"$OUT/smoke.log" 2>&1
  smoke=$?
  tail -30 "$OUT/smoke.log"
  if [[ ${SANITIZE_SMOKE:-0} == 1 ]]; then
    for tool in memcheck racecheck; do
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" timeout "${SANITIZE_TIMEOUT:-150}" \
          compute-sanitizer --tool $tool --kernel-name kns=Mla --error-exitcode 3 python3 $SMOKE \
          >"$OUT/smoke_$tool.log" 2>&1
      echo "$tool: exit $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/smoke_$tool.log" | tail -1))"
    done
  fi
fi
if [[ ${TESTS:-1} != 0 ]]; then
  echo "== MLA GPU tests ($(date +%T))"
  timeout "${TEST_TIMEOUT:-150}" python3 -m pytest tests/test_mla_gpu.py -k "${TESTS_K:-Gpu}" -v -n 4 \
      -p no:cacheprovider --tb=short >"$OUT/tests.log" 2>&1
  echo "tests: exit $?"
  grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" "$OUT/tests.log" | tail -40
fi
[[ ${BENCH:-1} != 0 ]] || exit 0
echo "== MLA benchmark ($(date +%T))"
[[ $smoke == 0 ]] || { echo "skipped: the smoke script failed (exit $smoke)"; exit 1; }
# shellcheck disable=SC2086  # KV_DTYPES is a list
timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_mla.py \
    --kv-dtypes ${KV_DTYPES:-bfloat16 float8_e4m3fn} --out "$OUT/bench_mla.json" "$@" 2>&1 \
    | tee "$OUT/bench.log"
echo "== done ($(date +%T))"
