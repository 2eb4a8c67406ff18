#!/usr/bin/env bash
# Times kernel alternatives (scripts/build_alternative.sh) against the shipped
# build on one GPU: cuDNN once, then ROUNDS rounds (default 3) in which the
# shipped build and every library in .gpu/alt take their turn, so that each
# difference can be read against the spread of the shipped build's own
# timings (one timing moves by 2-3% from run to run). The shipped build also
# closes each round as "control": the same kernels in another slot moved by
# 4% at some configurations (results runs 118 and 124), so a difference
# smaller than shipped against control is none.
#
#   ROUNDS=4 bash scripts/gpu_alternatives.sh AOT_DIR [bench_attention.py args...]
#
# Builds like gpu_check.sh (its "none" stage); rows go to $OUT/alternatives.json
# with variants NAME-ROUND ("shipped-1", ...), and benchmarks/compare_variants.py
# prints the medians of each library (also to $OUT/variants.txt).
set -uo pipefail
AOT_DIR=${1:?usage: gpu_alternatives.sh AOT_DIR [bench args]}
shift
OUT=${OUT:-$PWD/gpu_out}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT"
bash "$(dirname "$0")/gpu_check.sh" "$AOT_DIR" none || exit 1
bench() {
  python3 benchmarks/bench_attention.py --out "$OUT/alternatives.json" "$@" \
      >>"$OUT/alternatives.log" 2>&1 || tail -5 "$OUT/alternatives.log"
}
bench --impls cudnn "$@"
for round in $(seq "$ROUNDS"); do
  echo "== round $round of $ROUNDS ($(date +%T))"
  bench --impls jax_flash --variant "shipped-$round" "$@"
  for library in .gpu/alt/*.so; do
    [[ -e $library ]] || continue
    JAX_FLASH_CUDA_LIBRARY=$library bench --impls jax_flash --variant "$(basename "$library" .so)-$round" "$@"
  done
  bench --impls jax_flash --variant "control-$round" "$@"
done
python3 benchmarks/compare_variants.py "$OUT/alternatives.json" | tee "$OUT/variants.txt"
