"""The differentiable kernel call: forward and backward kernels tied together
with ``jax.custom_vjp``. The forward saves (q, k, v, out, lse); the backward
recomputes the probabilities tile by tile in its own kernel, and the
sinks' gradient from per-row quantities."""

import functools

import jax
import jax.numpy as jnp

from jax_flash import _kernels as kernels, _sharding as sharding
from jax_flash._call import KernelCall, MaskOperands, PerPlatform, runs_kernels

_SECOND_ORDER = (
    "jax_flash: second-order gradients (the gradient of a gradient, Hessians) of attention "
    "are not supported: the backward kernel has no derivative of its own. Use "
    "implementation='xla' for them.")


def _first_order_only(kernel):
  """``kernel(*arrays, call)`` that raises a clear NotImplementedError when
  differentiated (which only a second-order gradient does: the custom_vjp
  below differentiates the kernels by hand)."""

  @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
  def run(call, *arrays):
    return kernel(*arrays, call)

  @run.defjvp
  def _jvp(call, primals, tangents):
    raise NotImplementedError(_SECOND_ORDER)

  return lambda *args: run(args[-1], *args[:-1])


_kernel_forward = _first_order_only(sharding.forward)
_kernel_backward = _first_order_only(sharding.backward)


# A call that runs plain XLA everywhere stays out of the sharding machinery
# (XLA partitions its operations itself) and may be differentiated again.
def _run_forward(*args):
  return (_kernel_forward if runs_kernels(args[-1]) else kernels.forward)(*args)


def _run_backward(*args):
  return (_kernel_backward if runs_kernels(args[-1]) else kernels.backward)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def flash_attention(q, k, v, masks: MaskOperands, sinks, call: KernelCall | PerPlatform):
  """Returns (out, lse) from the kernels ``call`` names, the sinks
  (_call.sink_operand) included."""
  return _run_forward(q, k, v, masks, sinks, call)


def _forward(q, k, v, masks, sinks, call):
  out, lse = _run_forward(q, k, v, masks, sinks, call)
  return (out, lse), (q, k, v, out, lse, masks, sinks)


def _backward(call, residuals, cotangents):
  q, k, v, out, lse, masks, sinks = residuals
  dout, dlse = cotangents
  # d(lse)/d(scores) is the probability row, so an lse cotangent folds into
  # the same correction term as rowsum(dout * out). With sinks, out and lse
  # include them: the kernels' P = exp(s - lse) are then the rows' true
  # probabilities and delta is theirs, so no backward kernel sees the sinks.
  acc = lse.dtype
  delta = jnp.einsum("...tnh,...tnh->...nt", dout.astype(acc), out.astype(acc))
  delta = delta - dlse.astype(acc)
  dq, dk, dv = _run_backward(q, k, v, dout.astype(q.dtype), lse, delta, masks, call)
  return dq.astype(q.dtype), dk, dv, None, _sink_gradient(sinks, lse, delta)


def _sink_gradient(sinks, lse, delta):
  """d loss / d sinks ([..., N, 1], _call.sink_operand's layout; empty without
  sinks). A row's sink probability p = exp(sink - lse) moves its lse by p
  and its output by -p * out per unit of sink, so the row adds p * (dlse -
  rowsum(dout * out)) = -p * delta. A row that sees no key has lse = sink
  and p = 1 (also for a sink of -inf, where the subtraction would be NaN)."""
  if not sinks.shape[-1]:
    return jnp.zeros_like(sinks)
  gap = jnp.where(lse == sinks, 0.0, sinks - lse)  # [..., N, 1] against [..., N, T]
  return -jnp.sum(jnp.exp(gap) * delta, axis=-1, keepdims=True)


flash_attention.defvjp(_forward, _backward)
