#!/usr/bin/env bash
# Sharded attention on every GPU of one machine (issue 6): build jax_flash
# from kernels exported ahead of time (as gpu_check.sh does), run the
# multi-GPU tests, then benchmark ring attention, data and tensor parallelism
# against one GPU.
#
#   bash scripts/gpu_multi.sh AOT_DIR
#
# AOT_DIR: see gpu_check.sh (make it with scripts/prepare_gpu_run.sh). Logs
# and bench_multi.json go to $OUT (default ./gpu_out). Every step has a time
# limit, so that the whole script ends within 8 minutes.
set -uo pipefail
AOT_DIR=$(realpath "${1:?usage: gpu_multi.sh AOT_DIR}")
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}

step() { echo "== $* ($(date +%T))"; }

if ! "$PYTHON" -c "import jax_flash; assert jax_flash.cuda_kernels_available()" 2>/dev/null; then
  step "build (prebuilt kernels from $AOT_DIR)"
  if ! timeout 180 "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -e . \
      -Ccmake.define.JAX_FLASH_CUDA=ON -Ccmake.define.JAX_FLASH_AOT_DIR="$AOT_DIR" \
      -Cbuild-dir=/tmp/jax_flash_build >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    exit 1
  fi
fi
nvidia-smi -L | tee "$OUT/gpus.txt"

step "multi-GPU tests"
# One process uses every GPU; the float64 references need memory beside the kernels.
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 "$PYTHON" -m pytest tests/test_multi_gpu.py -q \
    -rs -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/tests_multi.log"
tests_status=${PIPESTATUS[0]}
echo "tests: exit $tests_status"

step "benchmark"
timeout 180 "$PYTHON" benchmarks/bench_sharded.py --iters 3 --reps 5 --dense-iters 30 \
    --out "$OUT/bench_multi.json" 2>&1 | tee "$OUT/bench_multi.log"
bench_status=${PIPESTATUS[0]}
echo "benchmark: exit $bench_status"
step "ring benchmark with XLA's latency-hiding scheduler"
timeout 120 "$PYTHON" benchmarks/bench_sharded.py --overlap --parts ring --iters 3 --reps 5 \
    --out "$OUT/bench_multi.json" 2>&1 | tee -a "$OUT/bench_multi.log"
step done
exit $(( tests_status != 0 ? tests_status : bench_status ))
