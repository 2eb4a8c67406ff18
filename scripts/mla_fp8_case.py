"""A small MLA decode against the FP8 cache on the Hopper kernel
(cuda_src/mla_sm90/kernel_fp8.py), compared with the XLA composition of the
same maths, for a first look on a GPU and for compute-sanitizer: 16 heads
at s_q 2 (one tile of 32 rows) and 128 heads at s_q 1 (two tiles), with
lengths that end inside a page, a split boundary (1024 / 2048 keys) and a
sequence of one token. Exits 1 when the kernel's output is not finite where
the composition's is, or differs from it by more than 10% of the largest
output, or its lse by more than 0.1 (the tests hold it to the tolerance
principle; this only catches a broken kernel)."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _mla_fp8 as mla_fp8

failed = False
for heads, s_q in ((16, 2), (128, 1)):
  lengths = [1, 1000, 2049]
  pages = [-(-n // 64) for n in lengths]
  keys = jax.random.split(jax.random.key(heads), 2)
  rows = jax.random.normal(keys[0], (sum(pages), 64, 576), jnp.bfloat16)
  cache = jax_flash.MlaFp8Cache(*mla_fp8.quantize_latent(rows))
  table = np.zeros((len(lengths), max(pages)), np.int32)
  start = 0
  for b, n in enumerate(pages):
    table[b, :n] = np.arange(start, start + n)[::-1]
    start += n
  q = jax.random.normal(keys[1], (len(lengths), s_q, heads, 576), jnp.bfloat16)
  args = (q, cache, jnp.asarray(table), jnp.asarray(lengths, jnp.int32))
  outs = {}
  for implementation in ("flash", "xla"):
    out, lse = jax_flash.mla_decode(
        *args, scale=192 ** -0.5, return_lse=True, implementation=implementation,
        query_lengths=jnp.asarray([min(n, s_q) for n in lengths], jnp.int32))
    outs[implementation] = (np.asarray(out, np.float32), np.asarray(lse))
  (out, lse), (ref, ref_lse) = outs["flash"], outs["xla"]
  finite = (np.array_equal(np.isfinite(out), np.isfinite(ref))
            and np.array_equal(lse == -np.inf, ref_lse == -np.inf))
  error = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
  seen = np.isfinite(ref_lse)
  lse_error = np.max(np.abs(lse[seen] - ref_lse[seen]))
  print(f"heads {heads} s_q {s_q}: max |flash - xla| / max |xla| = {error:.3g}, "
        f"lse {lse_error:.3g}, finite alike: {finite}", flush=True)
  failed |= not finite or not error <= 0.1 or not lse_error <= 0.1
sys.exit(1 if failed else 0)
