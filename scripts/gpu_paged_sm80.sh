#!/usr/bin/env bash
# The sm80 paged kernel on a GPU machine: build against AOT_DIR (prepared
# on the CPU machine: the exported kernel families, fwd_sm80's with its
# jf_fwdpaged_* variants), check that the paged handler has it, then the
# paged GPU tests (on a Hopper GPU the sm80 kernel serves head dims 96 and
# 192: TestPagedSm80Gpu and those head dims of TestPagedGpu) and the sm80
# forward's own GPU tests where Hopper hands calls to it.
#
#   bash scripts/gpu_paged_sm80.sh AOT_DIR
set -uo pipefail
AOT_DIR=$(realpath "${1:?usage: gpu_paged_sm80.sh AOT_DIR}")
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
t0=$(date +%s)
lap() { echo "== $1 at $(( $(date +%s) - t0 )) s"; }
left() { echo $(( ${LIMIT:-580} - ($(date +%s) - t0) )); }

# Built here whatever jax_flash this machine has installed (gpu_check.sh
# would keep one that works), in a build folder of its own.
if ! "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -e . \
    -Ccmake.define.JAX_FLASH_CUDA=ON -Ccmake.define.JAX_FLASH_AOT_DIR="$AOT_DIR" \
    -Ccmake.define.JAX_FLASH_CUDA_TOOLKIT=SYSTEM \
    -Cbuild-dir=/tmp/jax_flash_build_paged80 >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
lap build
"$PYTHON" - <<'PY' || exit 1
import ctypes, pathlib
import jax_flash
from jax_flash import _ffi, _paged
here = pathlib.Path.cwd().resolve()
assert pathlib.Path(jax_flash.__file__).resolve().is_relative_to(here), jax_flash.__file__
library = _ffi._cuda_library
assert library is not None and getattr(library, "jax_flash_fwd_sm80_paged", None), "no sm80 paged kernel"
print("jax_flash from", jax_flash.__file__, "| paged GPU kernels registered:", _paged._CUDA_REGISTERED,
      "| capability", _ffi.gpu_compute_capability())
PY
lap check
timeout "$(left)" "$PYTHON" -m pytest -v -rf -n 8 -p no:cacheprovider --maxfail=30 \
    tests/test_paged.py tests/test_paged_sm80.py tests/test_paged_sinks.py tests/test_backends.py \
    -k "PagedGpu or PagedSm80Gpu or PagedSinksGpu or gpu_kernel_reasons or (Gpu and fallback_kernels)" \
    >"$OUT/tests.log" 2>&1
echo "pytest exit $?"
lap tests
grep -E "^(FAILED|ERROR)|passed|failed|skipped" "$OUT/tests.log" | tail -40
echo "== per class:"
for cls in TestPagedGpu TestPagedSm80Gpu PagedSinksGpu fallback_kernels; do
  echo "$cls: $(grep -c "$cls.*PASSED" "$OUT/tests.log") passed, $(grep -c "$cls.*FAILED" "$OUT/tests.log") failed, $(grep -c "$cls.*SKIPPED" "$OUT/tests.log") skipped"
done
