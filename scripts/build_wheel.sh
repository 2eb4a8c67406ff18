#!/usr/bin/env bash
# Builds jax_flash's wheels, which install without a compiler, a CUDA toolkit
# or the CuTe DSL: one per CPython ABI of the nanobind CPU module, compiling
# the GPU kernels once.
#
#   bash scripts/build_wheel.sh [OUT_DIR]          (default: build/wheels)
#
# PYTHONS lists the interpreters (default "python3.11 python3.12"). The first
# builds everything; each other one builds only its CPU module and links the
# first build's kernels (JAX_FLASH_AOT_DIR), which hold no Python. Python
# 3.11 gives a cp311 wheel, 3.12 a cp312-abi3 one that also serves every
# later version (pyproject.toml: wheel.py-api). Build folders:
# build/wheel-py<version>, kept for the next, incremental, run. With
# JAX_FLASH_AOT_DIR set (e.g. build/dev/aot, which an editable install
# made), every wheel links those kernels and none compiles them.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/wheels}
read -r -a pythons <<<"${PYTHONS:-python3.11 python3.12}"
for python in "${pythons[@]}"; do
  "$python" -c "" 2>/dev/null || {
    echo "build_wheel.sh: $python does not run here; set PYTHONS to the interpreters," \
         "e.g. PYTHONS=\"python3.11 /opt/python3.12/bin/python3.12\"" >&2
    exit 1
  }
done
mkdir -p "$OUT"
rm -f "$OUT"/jax_flash-*.whl

aot=${JAX_FLASH_AOT_DIR:+$(realpath "$JAX_FLASH_AOT_DIR")}
for python in "${pythons[@]}"; do
  version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  build="build/wheel-py$version"
  args=(-Cbuild-dir="$build")
  [[ -n $aot ]] && args+=(-Ccmake.define.JAX_FLASH_AOT_DIR="$aot")
  start=$(date +%s)
  "$python" -m pip wheel --no-deps --wheel-dir "$OUT" "${args[@]}" .
  echo "build_wheel.sh: Python $version wheel built in $(( $(date +%s) - start )) s" \
       "(${aot:+kernels from $aot, }build folder $build)"
  aot=${aot:-$PWD/$build/aot}
done
ls -l "$OUT"/jax_flash-*.whl
