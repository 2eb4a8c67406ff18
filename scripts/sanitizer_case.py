"""A small forward + backward on the GPU kernels, for compute-sanitizer:
head dims whose Hopper kernels differ in structure (hd64: three forward
consumers; hd192: the split-head-dim backward with its TMA dQ tile; hd256:
the same with dQ written over its spent Q / dO stage; 192 / 128: the forward
with V and O narrower than Q, O staged over part of Q's buffer), each
backward also in its deterministic variant (dQ turns between CTAs, several
dQ writer warps; two dQ accumulators at hd192 and 192 / 128 without a mask,
and four over 4500 keys, where on 132 SMs a head's KV tiles rotate in two groups),
the soft-capped backward at hd64 and hd128 (tanh recovered from P, dQ
transposed), the hd64 and hd128 backward over three and four query tiles
(warpgroups out of step, dQ added in halves: bwd_sm90/staggered.py), plain
and deterministic (each half with turns of its own), and a
long non-causal forward at hd128, whose CTAs pair up to multicast K / V
(kernel.py kv_multicast)."""

import jax
import jax.numpy as jnp

import jax_flash

for head_dim, head_dim_v in ((64, 64), (192, 192), (256, 256), (192, 128)):
  keys = jax.random.split(jax.random.key(head_dim + head_dim_v), 3)
  q = jax.random.normal(keys[0], (2, 77, 4, head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (2, 130, 2, head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (2, 130, 2, head_dim_v), jnp.bfloat16)
  for causal in (False, True):
    for deterministic in (False, True):
      loss = lambda q, k, v: jnp.sum(jax_flash.attention(
          q, k, v, causal=causal, deterministic=deterministic, implementation="gpu").astype(jnp.float32))
      grads = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
      jax.block_until_ready(grads)
keys = jax.random.split(jax.random.key(2), 3)
q = jax.random.normal(keys[0], (2, 70, 2, 192), jnp.bfloat16)
k = jax.random.normal(keys[1], (2, 4500, 1, 192), jnp.bfloat16)
v = jax.random.normal(keys[2], (2, 4500, 1, 128), jnp.bfloat16)
loss = lambda q, k, v: jnp.sum(jax_flash.attention(
    q, k, v, key_value_seq_lengths=jnp.array([4500, 3400], jnp.int32), deterministic=True,
    implementation="gpu").astype(jnp.float32))
jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))
for head_dim in (64, 128):
  q, k, v = (jax.random.normal(key, (2, 150, 2, head_dim), jnp.bfloat16)
             for key in jax.random.split(jax.random.key(head_dim), 3))
  loss = lambda q, k, v: jnp.sum(jax_flash.attention(
      q, k, v, causal=True, softcap=20.0, implementation="gpu").astype(jnp.float32))
  jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))
for head_dim in (64, 128):
  q, k, v = (jax.random.normal(key, (2, 300, 2, head_dim), jnp.bfloat16)
             for key in jax.random.split(jax.random.key(3), 3))
  for causal in (False, True):
    for deterministic in (False, True):
      loss = lambda q, k, v: jnp.sum(jax_flash.attention(
          q, k, v, causal=causal, deterministic=deterministic, implementation="gpu").astype(jnp.float32))
      jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))
keys = jax.random.split(jax.random.key(1), 3)
q = jax.random.normal(keys[0], (2, 4097, 2, 128), jnp.bfloat16)
k, v = (jax.random.normal(key, (2, 130, 1, 128), jnp.bfloat16) for key in keys[1:])
out = jax.jit(lambda q, k, v: jax_flash.attention(
    q, k, v, query_seq_lengths=jnp.array([4097, 3900], jnp.int32), implementation="gpu"))(q, k, v)
jax.block_until_ready(out)
print("sanitizer case done")
