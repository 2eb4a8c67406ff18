"""A small paged call on an FP8 cache for compute-sanitizer (memcheck,
racecheck): the Hopper FP8-cache kernel at head dims 64 and 128, decode
steps with GQA heads packed and a prefill chunk, pages of 16 and 64 in a
shuffled pool, lengths that end inside a page and a split."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

for head_dim, page_size, new in ((64, 16, 1), (128, 64, 1), (128, 16, 37)):
  lengths = np.array([1, 300, 4100 + new], np.int32)
  max_pages = -(-int(lengths.max()) // page_size)
  pages = 3 * max_pages
  keys = jax.random.split(jax.random.key(head_dim + new), 3)
  pool = jax.random.normal(keys[0], (2, pages, page_size, 2, head_dim), jnp.float32)
  k_pages, v_pages = map(jax_flash.Fp8Pages.quantize, pool)
  table = np.random.default_rng(new).permutation(pages)[:3 * max_pages].reshape(3, max_pages)
  q = jax.random.normal(keys[2], (3, new, 8, head_dim), jnp.bfloat16)
  out = jax.jit(lambda q, k, v, t, n: jax_flash.paged_attention(
      q, k, v, t, n, query_lengths=jnp.minimum(n, new), kv_split_size=2048,
      implementation="flash"))(q, k_pages, v_pages, jnp.asarray(table, jnp.int32),
                               jnp.asarray(lengths))
  jax.block_until_ready(out)
print("paged FP8 case done")
