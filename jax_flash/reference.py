"""Attention as plain XLA operations.

This is both the ``implementation="xla"`` backend (in the input dtype, with a
float32 softmax, differentiable by autodiff) and the reference the tests
compare every kernel against (``compute_dtype=jnp.float32`` or float64). It
materialises the [T, S] score matrix, so it is for moderate sizes.
"""

import jax
import jax.numpy as jnp


def visible_mask(seq_q: int, seq_k: int, *, diag_offset: int, window_left: int,
                 window_right: int, q_lens=None, kv_lens=None, q_segment_ids=None,
                 kv_segment_ids=None):
  """Boolean [B or 1, 1, T, S]: which key each query row may attend to.

  The convention of ``cuda_src/include/jax_flash/kernel_api.h``: row i sees
  column j when ``i + diag_offset - window_left <= j <= i + diag_offset +
  window_right`` (a negative window is unbounded on that side), both lie
  within their sequence lengths and, with segment ids, carry the same id.
  """
  rows = jnp.arange(seq_q)[:, None]
  cols = jnp.arange(seq_k)[None, :]
  visible = jnp.ones((seq_q, seq_k), bool)
  if window_left >= 0:
    visible &= cols >= rows + diag_offset - window_left
  if window_right >= 0:
    visible &= cols <= rows + diag_offset + window_right
  visible = visible[None, None]
  if q_lens is not None:
    visible = visible & (jnp.arange(seq_q)[None, None, :, None] < q_lens[:, None, None, None])
  if kv_lens is not None:
    visible = visible & (jnp.arange(seq_k)[None, None, None, :] < kv_lens[:, None, None, None])
  if q_segment_ids is not None:
    visible = visible & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
  return visible


def attention_reference(q, k, v, *, scale: float, diag_offset: int = 0, window_left: int = -1,
                        window_right: int = -1, q_lens=None, kv_lens=None, q_segment_ids=None,
                        kv_segment_ids=None, softcap: float = 0.0, compute_dtype=None):
  """Masked softmax attention; returns (out [B,T,N,Hv], lse [B,N,T] float32).

  ``compute_dtype=None`` multiplies in the input dtype with float32
  accumulation and a float32 softmax (what a naive implementation does);
  ``jnp.float32`` / ``jnp.float64`` upcast everything first (the reference).
  Rows that see no key give a zero output and an lse of -inf, with finite
  gradients. ``softcap > 0`` caps the logits: ``softcap * tanh(logit /
  softcap)``.
  """
  out_dtype = q.dtype
  if compute_dtype is not None:
    q, k, v = (x.astype(compute_dtype) for x in (q, k, v))
  acc_dtype = jnp.promote_types(q.dtype, jnp.float32)
  batch, seq_q, heads_q, head_dim = q.shape
  _, seq_k, heads_kv, _ = k.shape
  group = heads_q // heads_kv
  qg = q.reshape(batch, seq_q, heads_kv, group, head_dim)
  scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=acc_dtype)
  scores = scores.astype(acc_dtype) * jnp.asarray(scale, acc_dtype)
  if softcap:
    cap = jnp.asarray(softcap, acc_dtype)
    scores = cap * jnp.tanh(scores / cap)
  visible = visible_mask(seq_q, seq_k, diag_offset=diag_offset, window_left=window_left,
                         window_right=window_right, q_lens=q_lens, kv_lens=kv_lens,
                         q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  visible = visible[:, :, None]  # broadcast over [B, K, G, T, S]
  scores = jnp.where(visible, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  probs = jnp.exp(scores - row_max)
  row_sum = jnp.sum(probs, axis=-1, keepdims=True)
  seen = row_sum > 0
  safe_sum = jnp.where(seen, row_sum, 1.0)
  probs = probs / safe_sum
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v, preferred_element_type=acc_dtype)
  out = out.reshape(batch, seq_q, heads_q, v.shape[-1]).astype(out_dtype)
  lse = jnp.where(seen, row_max + jnp.log(safe_sum), -jnp.inf)[..., 0]
  lse = lse.reshape(batch, heads_q, seq_q).astype(jnp.promote_types(acc_dtype, jnp.float32))
  return out, lse
