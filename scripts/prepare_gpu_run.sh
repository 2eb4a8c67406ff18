#!/usr/bin/env bash
# Gathers what a GPU machine without the CuTe DSL needs into .gpu (git-ignored):
# pass `.gpu` as a carried path and run scripts/gpu_check.sh there.
#
#   bash scripts/prepare_gpu_run.sh                AOT archives of the local build
#                                                  -> .gpu/aot     (gpu_check.sh .gpu/aot)
#   bash scripts/prepare_gpu_run.sh --wheel [DIST] the wheels of DIST (default build/wheels,
#                                                  made by scripts/build_wheel.sh)
#                                                  -> .gpu/wheels  (gpu_check.sh .gpu/wheels)
# The first empties .gpu, the second replaces .gpu/wheels only: for both, in that order.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ${1:-} == --wheel ]]; then
  dist=${2:-build/wheels}
  compgen -G "$dist/jax_flash-*.whl" >/dev/null || {
    echo "prepare_gpu_run.sh: no jax_flash wheel in $dist; run scripts/build_wheel.sh $dist" >&2
    exit 1
  }
  rm -rf .gpu/wheels && mkdir -p .gpu/wheels
  cp "$dist"/jax_flash-*.whl .gpu/wheels/
  ls -l .gpu/wheels
  exit 0
fi
build=$(ls -d build/*/aot | head -1)
rm -rf .gpu && mkdir -p .gpu
cp -r "$build" .gpu/aot
# The shards' own folders repeat the combined ones.
rm -rf .gpu/aot/*.shards
# CMake links the archives and includes the headers; the loose objects repeat
# the archives and would take a third of the 64 MiB a GPU call can carry.
find .gpu/aot -name "*.o" -delete
runtime=$(python3 -c "import nvidia_cutlass_dsl, pathlib; print(pathlib.Path(list(nvidia_cutlass_dsl.__path__)[0]) / 'cu13/lib/libcuda_dialect_runtime_static.a')")
cp "$runtime" .gpu/aot/
du -sh .gpu
