"""A small paged call on a bfloat16 cache for compute-sanitizer (memcheck,
racecheck): the Hopper paged kernel at head dims 64, 128 and 256, with
pages of 64 and 128 keys (loaded in 64-key boxes where the tile allows) and
of 48 (16-key boxes), decode steps with GQA heads packed and prefill
chunks, a shuffled pool, lengths that end inside a page and a split."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

for head_dim, page_size, new in ((64, 64, 1), (128, 64, 37), (128, 128, 5), (128, 48, 3),
                                 (256, 64, 9)):
  lengths = np.array([1, 300, 4100 + new], np.int32)
  max_pages = -(-int(lengths.max()) // page_size)
  pages = 3 * max_pages
  keys = jax.random.split(jax.random.key(head_dim + new), 3)
  k_pages, v_pages = jax.random.normal(keys[0], (2, pages, page_size, 2, head_dim), jnp.bfloat16)
  table = np.random.default_rng(new).permutation(pages).reshape(3, max_pages)
  q = jax.random.normal(keys[2], (3, new, 8, head_dim), jnp.bfloat16)
  out = jax.jit(lambda q, k, v, t, n: jax_flash.paged_attention(
      q, k, v, t, n, query_lengths=jnp.minimum(n, new),
      kv_split_size=2048 // page_size * page_size, implementation="flash"))(
          q, k_pages, v_pages, jnp.asarray(table, jnp.int32), jnp.asarray(lengths))
  jax.block_until_ready(out)
print("paged case done")
