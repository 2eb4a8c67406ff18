"""The differentiable kernel call: forward and backward kernels tied together
with ``jax.custom_vjp``. The forward saves (q, k, v, out, lse); the backward
recomputes the probabilities tile by tile in its own kernel."""

import functools

import jax
import jax.numpy as jnp

from jax_flash import ffi


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def flash_attention(q, k, v, q_lens, kv_lens, call: ffi.KernelCall):
  """Returns (out, lse) from the kernels of ``call.backend``."""
  return ffi.forward(q, k, v, q_lens, kv_lens, call)


def _forward(q, k, v, q_lens, kv_lens, call):
  out, lse = ffi.forward(q, k, v, q_lens, kv_lens, call)
  return (out, lse), (q, k, v, out, lse, q_lens, kv_lens)


def _backward(call, residuals, cotangents):
  q, k, v, out, lse, q_lens, kv_lens = residuals
  dout, dlse = cotangents
  # d(lse)/d(scores) is the probability row, so an lse cotangent folds into
  # the same correction term as rowsum(dout * out).
  delta = jnp.einsum("...tnh,...tnh->...nt", dout.astype(jnp.float32), out.astype(jnp.float32))
  delta = delta - dlse.astype(jnp.float32)
  dq, dk, dv = ffi.backward(q, k, v, dout.astype(q.dtype), lse, delta, q_lens, kv_lens, call)
  return dq.astype(q.dtype), dk, dv, None, None


flash_attention.defvjp(_forward, _backward)
