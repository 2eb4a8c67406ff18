"""A small forward + backward on the GPU kernels, for compute-sanitizer."""

import jax
import jax.numpy as jnp

import jax_flash

keys = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(keys[0], (2, 77, 4, 64), jnp.bfloat16)
k = jax.random.normal(keys[1], (2, 130, 2, 64), jnp.bfloat16)
v = jax.random.normal(keys[2], (2, 130, 2, 64), jnp.bfloat16)
for causal in (False, True):
  loss = lambda q, k, v: jnp.sum(jax_flash.attention(q, k, v, causal=causal,
                                                     implementation="gpu").astype(jnp.float32))
  grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  jax.block_until_ready(grads)
print("sanitizer case done")
