"""The tolerance principle (docs/numerics.md), shared by every test.

A kernel's error against a float64 reference must be at most twice the error
of a naive implementation computed in the input dtype, plus one unit of
rounding per term of the longest reduction at the reference's magnitude
(``eps * sqrt(n) * max|ref|``: float32 kernels accumulate in another order than
XLA, and their error grows with the length of the sums).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _reference as reference


def random_qkv(seed, batch, seq_q, seq_k, heads_q, heads_kv, head_dim, dtype, head_dim_v=None):
  keys = jax.random.split(jax.random.key(seed), 4)
  head_dim_v = head_dim if head_dim_v is None else head_dim_v
  q = jax.random.normal(keys[0], (batch, seq_q, heads_q, head_dim), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (batch, seq_k, heads_kv, head_dim), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (batch, seq_k, heads_kv, head_dim_v), jnp.float32).astype(dtype)
  dout = jax.random.normal(keys[3], (batch, seq_q, heads_q, head_dim_v), jnp.float32).astype(dtype)
  return q, k, v, dout


def _to64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def reference_outputs(q, k, v, dout, *, compute_dtype, **mask):
  """(out, lse, dq, dk, dv) of the reference computed in compute_dtype (None:
  the input dtype, i.e. the naive implementation)."""
  arrays = {name: x for name, x in mask.items() if isinstance(x, (jax.Array, np.ndarray))}
  static = tuple(sorted((name, x) for name, x in mask.items() if name not in arrays))
  outputs = _jitted_reference(compute_dtype, static)(q, k, v, dout, arrays)
  return tuple(_to64(x) for x in outputs)


@functools.cache
def _jitted_reference(compute_dtype, static):
  """The reference's forward and backward as one jitted function: op by op
  it took about 6 s per check on a 2-core machine, jitted 1.3-1.6 s."""

  @jax.jit
  def outputs(q, k, v, dout, arrays):
    def run(q, k, v):
      return reference.attention_reference(q, k, v, compute_dtype=compute_dtype, **dict(static),
                                           **arrays)

    (out, lse), pullback = jax.vjp(run, q, k, v)
    return (out, lse, *pullback((dout.astype(out.dtype), jnp.zeros_like(lse))))

  return outputs


def float64_reference(q, k, v, dout, **mask):
  with jax.enable_x64(True):
    q64, k64, v64, d64 = (jnp.asarray(_to64(x)) for x in (q, k, v, dout))
    return reference_outputs(q64, k64, v64, d64, compute_dtype=jnp.float64, **mask)


def naive(q, k, v, dout, **mask):
  return reference_outputs(q, k, v, dout, compute_dtype=None, **mask)


def assert_within_tolerance(name, got, ref, naive_result, dtype, reduction=1):
  got, ref, naive_result = (np.asarray(x, np.float64) for x in (got, ref, naive_result))
  assert got.shape == ref.shape, f"{name}: shape {got.shape} != reference {ref.shape}"
  finite = np.isfinite(ref)
  assert np.array_equal(np.isfinite(got), finite), f"{name}: non-finite entries differ from the reference"
  assert np.array_equal(got[~finite], ref[~finite]), f"{name}: infinite entries differ"
  if not finite.any():
    return
  err = np.max(np.abs(got[finite] - ref[finite]))
  naive_err = np.max(np.abs(naive_result[finite] - ref[finite]))
  rounding = float(jnp.finfo(dtype).eps) * np.sqrt(reduction) * max(np.max(np.abs(ref[finite])), 1.0)
  bound = 2 * naive_err + rounding + 1e-6
  assert err <= bound, (f"{name}: max error {err:.3g} > bound {bound:.3g} "
                        f"(naive {dtype} error {naive_err:.3g})")
