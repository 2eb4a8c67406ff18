set -u
OUT=${OUT:-$PWD/gpu_out}
bash scripts/gpu_check.sh .gpu/aot none > $OUT/none.log 2>&1 || { tail -20 $OUT/none.log; exit 1; }
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== det tests with det-order.so ($(date +%T))"
JAX_FLASH_CUDA_LIBRARY=.gpu/alt/det-order.so timeout 150 python3 -m pytest tests/test_backends.py -k "Gpu and deterministic" -n 8 -p no:cacheprovider -q > $OUT/tests_det.log 2>&1
grep -E "FAILED|passed|failed|error" $OUT/tests_det.log | tail -8
for lib in shipped det-order; do
  echo "== $lib ($(date +%T))"
  if [[ $lib == shipped ]]; then unset JAX_FLASH_CUDA_LIBRARY; else export JAX_FLASH_CUDA_LIBRARY=.gpu/alt/$lib.so; fi
  python3 benchmarks/bench_attention.py --head-dims 64 128 192 256 --seqs 8192 --impls jax_flash cudnn --deterministic --variant $lib --out $OUT/det_order.json 2>&1 | grep -E "^\s+(64|128|192|256)"
done
echo "== done ($(date +%T))"
