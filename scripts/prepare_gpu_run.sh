#!/usr/bin/env bash
# Gathers the AOT kernel archives of the local build into .gpu/aot (git-ignored)
# so that a GPU machine without the CuTe DSL can link them: pass `.gpu` as a
# carried path and run `bash scripts/gpu_check.sh .gpu/aot` there.
set -euo pipefail
cd "$(dirname "$0")/.."
build=$(ls -d build/*/aot | head -1)
rm -rf .gpu && mkdir -p .gpu
cp -r "$build" .gpu/aot
# CMake links the archives and includes the headers; the loose objects repeat
# the archives and would take a third of the 64 MiB a GPU call can carry.
find .gpu/aot -name "*.o" -delete
runtime=$(python3 -c "import nvidia_cutlass_dsl, pathlib; print(pathlib.Path(list(nvidia_cutlass_dsl.__path__)[0]) / 'cu13/lib/libcuda_dialect_runtime_static.a')")
cp "$runtime" .gpu/aot/
du -sh .gpu
