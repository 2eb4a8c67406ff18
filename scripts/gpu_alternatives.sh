#!/usr/bin/env bash
# Times kernel alternatives (scripts/build_alternative.sh) against the shipped
# build on one GPU: the benchmark runs once per library, shipped first and
# last (to see the run-to-run spread), each with cuDNN in the same process.
#
#   bash scripts/gpu_alternatives.sh AOT_DIR [bench_attention.py args...]
#
# Builds like gpu_check.sh (its "none" stage); rows go to $OUT/alternatives.json
# with the alternative's name as their variant ("shipped", "shipped-again"
# for the build itself).
set -uo pipefail
AOT_DIR=${1:?usage: gpu_alternatives.sh AOT_DIR [bench args]}
shift
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
bash "$(dirname "$0")/gpu_check.sh" "$AOT_DIR" none || exit 1
bench() {
  python3 benchmarks/bench_attention.py --impls jax_flash cudnn --out "$OUT/alternatives.json" \
      --variant "$@" 2>&1 | grep -v "^wrote" | tee -a "$OUT/alternatives.log"
}
bench shipped "$@"
for library in .gpu/alt/*.so; do
  name=$(basename "$library" .so)
  JAX_FLASH_CUDA_LIBRARY=$library bench "$name" "$@"
done
bench shipped-again "$@"
