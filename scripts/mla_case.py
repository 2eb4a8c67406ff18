"""A small MLA decode against the bfloat16 cache on the Hopper kernel
(cuda_src/mla_sm90/kernel.py; with --fp8 the FP8 cache and kernel_fp8.py),
compared with the XLA composition of the same maths, for a
first look on a GPU and for compute-sanitizer: 16 heads at s_q 2 (one tile
of 32 rows) and 128 heads at s_q 1 and 2 (two and four tiles), with lengths
that end inside a page, after an odd and an even number of pages (the
kernel works on pairs of pages), on a split boundary and at one token. The
inputs come from numpy, so that the sanitizer sees few XLA kernels besides
the one under test; each call's time (compilation included) is printed.
Exits 1 when the kernel's output is not finite where the composition's is,
or differs from it by more than 5% (FP8: 10%) of the largest output, or its
lse by more than 0.05 (FP8: 0.1) (the tests hold it to the tolerance principle; this only
catches a broken kernel)."""

import sys
import time

import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _mla_fp8 as mla_fp8

fp8 = "--fp8" in sys.argv[1:]
limit = 0.1 if fp8 else 0.05

failed = False
rng = np.random.default_rng(0)
for heads, s_q in ((16, 2), (128, 1), (128, 2)):
  lengths = [1, 1000, 2049, 4097, 64 * 7]
  pages = [-(-n // 64) for n in lengths]
  pool = jnp.asarray(rng.standard_normal((sum(pages) + 2, 64, 576), np.float32), jnp.bfloat16)
  if fp8:
    pool = jax_flash.MlaFp8Cache(*mla_fp8.quantize_latent(pool))
  table = np.zeros((len(lengths), max(pages)), np.int32)
  order = rng.permutation(sum(pages) + 2)
  start = 0
  for b, n in enumerate(pages):
    table[b, :n] = order[start:start + n]
    start += n
  q = jnp.asarray(rng.standard_normal((len(lengths), s_q, heads, 576), np.float32), jnp.bfloat16)
  outs = {}
  for implementation in ("flash", "xla"):
    start_time = time.perf_counter()
    out, lse = jax_flash.mla_decode(
        q, pool, jnp.asarray(table), jnp.asarray(lengths, jnp.int32), scale=192 ** -0.5,
        return_lse=True, implementation=implementation,
        query_lengths=jnp.asarray([min(n, s_q) for n in lengths], jnp.int32))
    outs[implementation] = (np.asarray(out, np.float32), np.asarray(lse))
    print(f"heads {heads} s_q {s_q}: {implementation} in {time.perf_counter() - start_time:.1f} s",
          flush=True)
  (out, lse), (ref, ref_lse) = outs["flash"], outs["xla"]
  finite = (np.array_equal(np.isfinite(out), np.isfinite(ref))
            and np.array_equal(lse == -np.inf, ref_lse == -np.inf))
  error = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
  seen = np.isfinite(ref_lse)
  lse_error = np.max(np.abs(lse[seen] - ref_lse[seen]))
  print(f"heads {heads} s_q {s_q}: max |flash - xla| / max |xla| = {error:.3g}, "
        f"lse {lse_error:.3g}, finite alike: {finite}", flush=True)
  failed |= not finite or not error <= limit or not lse_error <= limit
sys.exit(1 if failed else 0)
