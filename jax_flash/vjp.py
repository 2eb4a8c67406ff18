"""The differentiable kernel call: forward and backward kernels tied together
with ``jax.custom_vjp``. The forward saves (q, k, v, out, lse); the backward
recomputes the probabilities tile by tile in its own kernel."""

import functools
import math

import jax
import jax.numpy as jnp

from jax_flash import configs, ffi, sharding


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def flash_attention(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds,
                    call: ffi.KernelCall):
  """Returns (out, lse) from the kernels of ``call.backend``; the integer
  operands are those of ``ffi.forward``."""
  return sharding.forward(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, call)


def _forward(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, call):
  masks = (q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds)
  out, lse = sharding.forward(q, k, v, *masks, call)
  return (out, lse), (q, k, v, out, lse, masks)


def _backward(call, residuals, cotangents):
  q, k, v, out, lse, masks = residuals
  dout, dlse = cotangents
  # d(lse)/d(scores) is the probability row, so an lse cotangent folds into
  # the same correction term as rowsum(dout * out).
  delta = jnp.einsum("...tnh,...tnh->...nt", dout.astype(jnp.float32), out.astype(jnp.float32))
  delta = delta - dlse.astype(jnp.float32)
  # A forward that took V narrower than the backward kernels do (configs:
  # native_value_dims): zero columns of V and dout change neither dP nor
  # dQ / dK, and their dV columns are cut off.
  head_dim_v = v.shape[-1]
  hopper = call.backend == "gpu" and (ffi.gpu_compute_capability() or (0,))[0] == 9
  hopper = hopper and configs.sm90_backward_serves(
      deterministic=call.deterministic, has_segments=masks[2].shape[-1] > 0,
      softcap=call.softcap > 0, batch=math.prod(q.shape[:-3]), heads_kv=k.shape[-2])
  padding = configs.BACKENDS[call.backend].value_padding(q.shape[-1], head_dim_v, hopper)
  if padding:
    widen = [(0, 0)] * (v.ndim - 1) + [(0, padding)]
    v, dout = jnp.pad(v, widen), jnp.pad(dout, widen)
  dq, dk, dv = sharding.backward(q, k, v, dout.astype(q.dtype), lse, delta, *masks, call)
  return (dq.astype(q.dtype), dk, dv[..., :head_dim_v]) + (None,) * len(masks)


flash_attention.defvjp(_forward, _backward)
