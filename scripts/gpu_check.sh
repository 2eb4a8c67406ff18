#!/usr/bin/env bash
# One call on a GPU machine: install jax_flash built on another machine --
# from a wheel, or built here from kernels exported ahead of time there --
# check it, run the GPU tests, benchmark.
#
#   bash scripts/gpu_check.sh WHEELS [tests|bench|all|none]
#   bash scripts/gpu_check.sh AOT_DIR [tests|bench|all|none]
#
# WHEELS: a jax_flash wheel or a folder of them (scripts/build_wheel.sh makes
# one per CPython ABI; scripts/prepare_gpu_run.sh --wheel carries them in
# .gpu/wheels). pip installs the one for this Python, without building and
# without dependencies (the machine has jax); the commands below then run
# with PYTHONSAFEPATH=1, so that the source tree's jax_flash/ does not shadow
# the installed package.
#
# The GPU tests (every test marked gpu) take about 970 s with 14 workers, more
# than a 600 s call (H200, 2026-11-28: 170 s, 451 s and 353 s for the three
# parts below, 98, 107 and 108 tests). TESTS_PART picks one; SANITIZE=0 skips
# the sanitizers (run them in one of the calls):
#   TESTS_PART=rest       every gpu test outside test_backends.py
#   TESTS_PART=backends1  test_backends.py -k "reference or every_head_dim or softcap or awkward"
#   TESTS_PART=backends2  test_backends.py, the others
# TESTS_K="EXPR" further keeps the tests that match a pytest -k expression.
#
# AOT_DIR holds what CMake's AOT step made (the lib<family>_<arch>.a archives,
# their header folders) plus libcuda_dialect_runtime_static.a; make it with
# scripts/prepare_gpu_run.sh. It is linked against this machine's CUDA
# toolkit (JAX_FLASH_CUDA_TOOLKIT=SYSTEM). Logs and results go to $OUT
# (default ./gpu_out).
set -uo pipefail
SOURCE=$(realpath "${1:?usage: gpu_check.sh WHEELS|AOT_DIR [tests|bench|all|none]}")
STAGE=${2:-all}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}

step() { echo "== $* ($(date +%T))"; }

if [[ $SOURCE == *.whl ]] || compgen -G "$SOURCE/jax_flash-*.whl" >/dev/null; then
  step "install the wheel ($SOURCE)"
  if [[ $SOURCE == *.whl ]]; then wheel=("$SOURCE"); else wheel=(--no-index --find-links "$SOURCE" jax_flash); fi
  if ! "$PYTHON" -m pip install --no-deps --force-reinstall "${wheel[@]}" >"$OUT/install.log" 2>&1; then
    tail -20 "$OUT/install.log"
    exit 1
  fi
  export PYTHONSAFEPATH=1
  "$PYTHON" -c "import jax_flash; assert jax_flash.cuda_kernels_available(), 'no CUDA kernels'; print('installed', jax_flash.__file__)" || exit 1
elif ! "$PYTHON" -c "import jax_flash; assert jax_flash.cuda_kernels_available()" 2>/dev/null; then
  AOT_DIR=$SOURCE
  step "build (prebuilt kernels from $AOT_DIR)"
  if ! "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -e . \
      -Ccmake.define.JAX_FLASH_CUDA=ON -Ccmake.define.JAX_FLASH_AOT_DIR="$AOT_DIR" \
      -Ccmake.define.JAX_FLASH_CUDA_TOOLKIT=SYSTEM \
      -Cbuild-dir=/tmp/jax_flash_build >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    exit 1
  fi
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader

if [[ $STAGE == tests || $STAGE == all ]]; then
  step "python -m jax_flash --no-bench"
  "$PYTHON" -m jax_flash --no-bench 2>&1 | tee "$OUT/check.log"
  # Before the tests, which take most of a 600 s call: a cut-off run still has these.
  step "compute-sanitizer memcheck + racecheck on a small problem"
  [[ ${SANITIZE:-1} == 0 ]] && echo "skipped (SANITIZE=0)"
  # XLA's autotuning under racecheck took most of a minute and at times
  # crashed it (exit 139, H100, 2026-11-22); the kernels checked are ours.
  [[ ${SANITIZE:-1} == 0 ]] || for tool in memcheck racecheck; do
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" compute-sanitizer --tool $tool --error-exitcode 3 "$PYTHON" scripts/sanitizer_case.py \
        >"$OUT/sanitizer_$tool.log" 2>&1
    echo "$tool: exit $? ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1))"
  done
  step "GPU tests"
  export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test processes share the GPU
  half="reference or every_head_dim or softcap or awkward"
  case ${TESTS_PART:-all} in
    all) part=(tests); k="" ;;
    rest) part=(tests --ignore=tests/test_backends.py); k="" ;;
    backends1) part=(tests/test_backends.py); k="($half)" ;;
    backends2) part=(tests/test_backends.py); k="not ($half)" ;;
    *) echo "TESTS_PART must be all, rest, backends1 or backends2, got $TESTS_PART"; exit 2 ;;
  esac
  [[ -n ${TESTS_K:-} ]] && k="${k:+$k and }(${TESTS_K})"
  [[ -n $k ]] && part+=(-k "$k")
  "$PYTHON" -m pytest -m gpu "${part[@]}" -v -n 14 -p no:cacheprovider --maxfail=20 --durations=5 \
      >"$OUT/tests.log" 2>&1
  # One line per test in the log (a cut-off run shows which ran); failures and the summary here.
  grep -E "FAILED|ERROR|passed|failed" "$OUT/tests.log" | tail -25
fi

if [[ $STAGE == bench || $STAGE == all ]]; then
  # Sized for under 5 minutes on an H100: about 140 measurements of about a second each.
  SEQS=${BENCH_SEQS:-1024 2048 4096 8192 16384 32768}
  step "benchmark: bf16, head dims 64 128 256 x seqs $SEQS x causal and not"
  "$PYTHON" benchmarks/bench_attention.py --head-dims 64 128 256 --seqs $SEQS \
      --out "$OUT/bench.json" --plot "$OUT/sweep_bf16.png" 2>&1 | tee "$OUT/bench.log"
  step "benchmark: fp16, head dim 128, with Pallas Mosaic GPU"
  "$PYTHON" benchmarks/bench_attention.py --dtype float16 --head-dims 128 --seqs $SEQS \
      --out "$OUT/bench.json" --plot "$OUT/sweep_fp16_hd128.png" 2>&1 | tee -a "$OUT/bench.log"
  step "benchmark: decoding (GQA packing, split-KV)"
  "$PYTHON" benchmarks/bench_decode.py --out "$OUT/bench.json" 2>&1 | tee -a "$OUT/bench.log"
  step "benchmark: packed documents"
  "$PYTHON" benchmarks/bench_attention.py --head-dims 128 --packed-docs 8 \
      --out "$OUT/bench.json" 2>&1 | tail -3 | tee -a "$OUT/bench.log"
fi
step done
