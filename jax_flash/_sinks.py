"""Attention sinks (gpt-oss): a learnable logit per query head added to every
softmax denominator, ``softmax([scale q k^T, sink])`` with no value row.

The sink changes a row's result only through its normaliser: with ``w =
exp(lse - lse_s) = sigmoid(lse - sink)``,

  ``lse_s = logaddexp(lse, sink)``, ``out_s = w * out``.

The Hopper forward kernel does this in its epilogue
(cuda_src/fwd_sm90/output_tile.py) where the forward plan says so
(``_plan.ForwardPlan.kernel_adds_sinks``); every other forward call (other
backends, packed GQA heads, split keys) gets it here, after the call. Ring and paged attention, which merge
partial results, add the sinks to the merged one. The kernels' backward
needs nothing of the sinks: it takes ``out_s`` and ``lse_s`` (vjp.py), and
the sinks' own gradient comes from per-row quantities (vjp.py:
_sink_gradient): no pass over K / V is added.
"""

import jax
import jax.numpy as jnp


def add_sinks(out, lse, sinks):
  """``(out, lse)`` of attention without sinks -> the same with them.

  ``out [..., T, N, Dv]``, ``lse [..., N, T]`` (natural log, ``-inf`` for
  rows that see no key), ``sinks`` float32 ``[N]`` (or ``[..., N]``, per
  batch entry). Rows that see no key
  keep a zero output and get ``lse = sink``; a sink of ``-inf`` leaves every
  result, and its gradients, bit for bit as they were. ``w`` and the rescale
  run in float32 (or the lse's wider dtype), rounded once to ``out``'s dtype.
  """
  acc = jnp.promote_types(lse.dtype, jnp.float32)
  lse = lse.astype(acc)
  sink = jnp.asarray(sinks, acc)[..., None]  # [..., N, 1] against [..., N, T]
  no_key = lse == -jnp.inf
  # A row without keys would make the gap NaN for a sink of -inf; its terms
  # are selected away, and a finite stand-in keeps their gradients finite.
  gap = jnp.where(no_key, 0.0, lse) - sink
  # sigmoid(+inf) is exactly 1 and its derivative exactly 0, as is that of
  # softplus(-inf): a sink of -inf changes no bit of the results or gradients.
  weight = jnp.where(no_key, 0.0, jax.nn.sigmoid(gap))
  lse_s = jnp.where(no_key, sink, lse + jax.nn.softplus(-gap))
  rescale = jnp.swapaxes(weight, -1, -2)[..., None]  # [..., N, T] -> [..., T, N, 1]
  return (out.astype(acc) * rescale).astype(out.dtype), lse_s
