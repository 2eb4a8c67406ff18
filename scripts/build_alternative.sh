#!/usr/bin/env bash
# Builds a copy of libjax_flash_cuda.so in which some kernels of one family
# are exported with other flags (a tile alternative), so that a GPU machine
# can time it against the shipped build in the same session:
#
#   bash scripts/build_alternative.sh NAME FAMILY "EXPORT ARGS" ["EXPORT ARGS"...]
#   bash scripts/build_alternative.sh fwd-n192 fwd_sm90 \
#       "--only jf_fwd90_sm_90a_bf16_hd64 --tile-n 192 --stages 4"
#
# Each quoted group is one run of cuda_src.FAMILY.export; the objects it
# writes replace those of the same name in the local build's family archive
# (needs the local build: pip install -e .), and the library is relinked with
# the main build's link command into .gpu/alt/NAME.so (git-ignored). A group
# "@OTHER_FAMILY" makes the groups after it export from that family, so that
# one library (the GPU machine takes one, 64 MiB carried in all) holds
# alternatives of two families:
#
#   bash scripts/build_alternative.sh two fwd_sm90 "--only ..." @bwd_sm90 "--only ..."
#
# The ptxas line of every re-exported kernel is printed. On the GPU machine:
#
#   JAX_FLASH_CUDA_LIBRARY=.gpu/alt/NAME.so python benchmarks/bench_attention.py --variant NAME ...
set -euo pipefail
NAME=${1:?usage: build_alternative.sh NAME FAMILY "EXPORT ARGS"...}
FAMILY=${2:?family, e.g. fwd_sm90}
shift 2
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# SOURCE: another checkout (e.g. a git worktree of the last commit) whose
# cuda_src to export from; the build and the output stay in this checkout.
SOURCE=${SOURCE:-$ROOT}
BUILD=$(ls -d "$ROOT"/build/*/ | head -1)
ARCH=sm_90a
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
families=()
use_family() {
  FAMILY=$1
  [[ -d $WORK/$FAMILY ]] || { cp -r "$BUILD/aot/${FAMILY}_${ARCH}" "$WORK/$FAMILY"; families+=("$FAMILY"); }
}
use_family "$FAMILY"
for args in "$@"; do
  if [[ $args == @* ]]; then
    use_family "${args#@}"
    continue
  fi
  mkdir -p "$WORK/export"
  # The package cuda_src is found in the working folder, which PYTHONSAFEPATH
  # would leave off sys.path.
  # shellcheck disable=SC2086  # the group is split into export.py's arguments
  (cd "$SOURCE" && env -u PYTHONSAFEPATH CUTE_DSL_ARCH=$ARCH CUTE_DSL_COMPILER_OPT="remarks{ptx}" \
      python3 -m "cuda_src.$FAMILY.export" --arch $ARCH --out "$WORK/export" $args) \
      >"$WORK/export.log" 2>&1 || { tail -30 "$WORK/export.log"; exit 1; }
  (cd "$ROOT" && env -u PYTHONSAFEPATH python3 - "$WORK/export.log") <<'PY'
import pathlib, sys
from cuda_src.export_kernels import ANSI_ESCAPE, ptxas_summary
for name, registers, spilled, advisories in ptxas_summary(ANSI_ESCAPE.sub("", pathlib.Path(sys.argv[1]).read_text())):
  print(f"{name}: {registers} registers, {spilled} bytes spilled {'; '.join(advisories)}")
PY
  cp "$WORK"/export/jf_*.o "$WORK/$FAMILY/"
  rm -rf "$WORK/export"
done
mkdir -p "$ROOT/.gpu/alt"
link=$(cd "$BUILD" && ninja -t commands libjax_flash_cuda.so | tail -1)
for family in "${families[@]}"; do
  ar rcs "$WORK/lib${family}_${ARCH}.a" "$WORK/$family"/*.o
  link=${link//"aot/lib${family}_${ARCH}.a"/"$WORK/lib${family}_${ARCH}.a"}
done
link=${link//"-o libjax_flash_cuda.so"/"-o $ROOT/.gpu/alt/$NAME.so"}
(cd "$BUILD" && eval "$link")
echo "wrote .gpu/alt/$NAME.so"
