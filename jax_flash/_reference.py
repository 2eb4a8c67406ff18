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


def _finite_or_zero(x):
  return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def _rows_finite(x):
  """Whether each row (last axis) of ``x`` is finite throughout."""
  return jnp.all(jnp.isfinite(x), axis=-1)


def _logits(q, k, *, scale: float, softcap: float, acc_dtype):
  """(logits, slope) [B, K, G, T, S] for q [B, T, K*G, H], k [B, S, K, H]:
  the scaled, optionally capped, q.k products, and d logit / d(scale q.k).

  NaN semantics: a logit that is not finite, or whose q or k row holds a
  non-finite value, is NaN, so it reaches exactly the query rows that see it
  (their softmax turns NaN). The products are formed from q and k with their
  non-finite entries zeroed: a masked pair's zero probability then never
  meets a NaN or Inf in the backward's dS K and dS^T Q products.
  """
  batch, seq_q, heads_q, head_dim = q.shape
  _, seq_k, heads_kv, _ = k.shape
  qg = q.reshape(batch, seq_q, heads_kv, heads_q // heads_kv, head_dim)
  raw = jnp.einsum("btkgh,bskh->bkgts", _finite_or_zero(qg), _finite_or_zero(k),
                   preferred_element_type=acc_dtype)
  raw = raw.astype(acc_dtype) * jnp.asarray(scale, acc_dtype)
  finite = (jnp.isfinite(raw) & jnp.moveaxis(_rows_finite(qg), 1, -1)[..., None]
            & jnp.moveaxis(_rows_finite(k), 1, -1)[:, :, None, None, :])
  raw = jnp.where(finite, raw, jnp.nan)
  if not softcap:
    return raw, jnp.ones((), acc_dtype)
  cap = jnp.asarray(softcap, acc_dtype)
  capped = jnp.tanh(raw / cap)
  return cap * capped, 1 - capped * capped


def _nonfinite_seen(visible, x, batch_dims: str):
  """[B, S or T, K, D] bool: whether an entry of ``x`` [B, T or S, K, D] that
  is not finite lies in a position the mask ``visible`` [B|1, T, S] pairs
  with; ``batch_dims`` names the einsum of the pairing ("ts" or "st")."""
  seen = visible.astype(jnp.float32)
  bad = (~jnp.isfinite(x)).astype(jnp.float32)
  return jnp.einsum(f"b{batch_dims},b{batch_dims[1]}kd->b{batch_dims[0]}kd",
                    jnp.broadcast_to(seen, (x.shape[0], *seen.shape[1:])), bad) > 0


def attention_reference(q, k, v, *, scale: float, diag_offset: int = 0, window_left: int = -1,
                        window_right: int = -1, q_lens=None, kv_lens=None, q_segment_ids=None,
                        kv_segment_ids=None, softcap: float = 0.0, sinks=None,
                        compute_dtype=None):
  """Masked softmax attention; returns (out [B,T,N,Hv], lse [B,N,T] float32).

  ``compute_dtype=None`` multiplies in the input dtype with float32
  accumulation and a float32 softmax (what a naive implementation does);
  ``jnp.float32`` / ``jnp.float64`` upcast everything first (the reference).
  Rows that see no key give a zero output and an lse of -inf, with finite
  gradients. ``softcap > 0`` caps the logits: ``softcap * tanh(logit /
  softcap)``. ``sinks`` ([N], one logit per query head) joins every row's
  softmax as one more column without a value; a row that sees no key then
  gives zeros and an lse of its sink. A NaN or Inf reaches the outputs of
  exactly the query rows that see it (``_logits``; a value entry makes that
  column NaN), and nothing a row does not see reaches it, its gradients
  included.
  """
  out_dtype = q.dtype
  if compute_dtype is not None:
    q, k, v = (x.astype(compute_dtype) for x in (q, k, v))
  acc_dtype = jnp.promote_types(q.dtype, jnp.float32)
  batch, seq_q, heads_q, _ = q.shape
  _, seq_k, heads_kv, _ = k.shape
  group = heads_q // heads_kv
  scores, _ = _logits(q, k, scale=scale, softcap=softcap, acc_dtype=acc_dtype)
  visible = visible_mask(seq_q, seq_k, diag_offset=diag_offset, window_left=window_left,
                         window_right=window_right, q_lens=q_lens, kv_lens=kv_lens,
                         q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids)
  scores = jnp.where(visible[:, :, None], scores, -jnp.inf)  # broadcast over [B, K, G, T, S]
  if sinks is not None:  # the sink column, always visible
    sink_column = jnp.asarray(sinks, acc_dtype).reshape(1, heads_kv, group, 1, 1)
    scores = jnp.concatenate(
        [scores, jnp.broadcast_to(sink_column, (*scores.shape[:-1], 1))], axis=-1)
  row_max = jnp.max(scores, axis=-1, keepdims=True, initial=-jnp.inf)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  probs = jnp.exp(scores - row_max)
  row_sum = jnp.sum(probs, axis=-1, keepdims=True)
  seen = row_sum != 0  # NaN too: a row that sees a NaN logit
  safe_sum = jnp.where(seen, row_sum, 1.0)
  probs = probs / safe_sum
  if sinks is not None:
    probs = probs[..., :seq_k]  # the sink has no value
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), _finite_or_zero(v),
                   preferred_element_type=acc_dtype)
  bad_values = _nonfinite_seen(visible[:, 0], v, "ts")[:, :, :, None]  # [B, T, K, 1, Hv]
  out = jnp.where(bad_values, jnp.nan, out)
  out = out.reshape(batch, seq_q, heads_q, v.shape[-1]).astype(out_dtype)
  lse = jnp.where(seen, row_max + jnp.log(safe_sum), -jnp.inf)[..., 0]
  lse = lse.reshape(batch, heads_q, seq_q).astype(jnp.promote_types(acc_dtype, jnp.float32))
  return out, lse


def _flat_batch(x, trailing: int):
  """``x`` with its dims before the last ``trailing`` folded into one."""
  return x.reshape(-1, *x.shape[x.ndim - trailing:])


def _segments_or_none(q_ids, kv_ids):
  if q_ids.shape[-1] == 0:  # _call.MaskOperands without packed documents
    return None, None
  return _flat_batch(q_ids, 1), _flat_batch(kv_ids, 1)


def forward_like_kernels(q, k, v, q_lens, kv_lens, q_ids, kv_ids, *, scale, diag_offset,
                         window_left, window_right, softcap):
  """``attention_reference`` on the forward kernels' operands (_kernels.forward:
  any leading batch dims, segment ids of length 0 for none)."""
  lead = q.shape[:-3]
  q_segments, kv_segments = _segments_or_none(q_ids, kv_ids)
  out, lse = attention_reference(
      _flat_batch(q, 3), _flat_batch(k, 3), _flat_batch(v, 3), scale=scale,
      diag_offset=diag_offset, window_left=window_left, window_right=window_right,
      q_lens=q_lens.reshape(-1), kv_lens=kv_lens.reshape(-1), q_segment_ids=q_segments,
      kv_segment_ids=kv_segments, softcap=softcap)
  return out.reshape(*lead, *out.shape[1:]), lse.reshape(*lead, *lse.shape[1:])


def backward_like_kernels(q, k, v, dout, lse, delta, q_lens, kv_lens, q_ids, kv_ids, *, scale,
                          diag_offset, window_left, window_right, softcap):
  """The backward kernels' computation in XLA: (dq, dk, dv) from the saved lse
  and ``delta = rowsum(dout * out) - dlse`` (_kernels.backward's operands), dq in
  float32 or wider. The NaN semantics of ``attention_reference``: every
  product pairs only what the mask lets meet."""
  lead = q.shape[:-3]
  q, k, v, dout = (_flat_batch(x, 3) for x in (q, k, v, dout))
  lse, delta = _flat_batch(lse, 2), _flat_batch(delta, 2)
  acc_dtype = jnp.promote_types(q.dtype, jnp.float32)
  batch, seq_q, heads_q, head_dim = q.shape
  _, seq_k, heads_kv, _ = k.shape
  group = heads_q // heads_kv
  q_segments, kv_segments = _segments_or_none(q_ids, kv_ids)
  visible = visible_mask(seq_q, seq_k, diag_offset=diag_offset, window_left=window_left,
                         window_right=window_right, q_lens=q_lens.reshape(-1),
                         kv_lens=kv_lens.reshape(-1), q_segment_ids=q_segments,
                         kv_segment_ids=kv_segments)
  logits, slope = _logits(q, k, scale=scale, softcap=softcap, acc_dtype=acc_dtype)
  rows = lambda x: x.reshape(batch, heads_kv, group, seq_q)[..., None].astype(acc_dtype)
  lse, delta = rows(lse), rows(delta)
  # Rows whose lse says they saw nothing have P = 0; a NaN lse stays NaN.
  keep = visible[:, :, None] & (lse != -jnp.inf)
  probs = jnp.where(keep, jnp.exp(logits - jnp.where(keep, lse, 0.0)), 0.0)
  grouped = lambda x: x.reshape(batch, seq_q, heads_kv, group, x.shape[-1])
  dout_g = grouped(dout)
  dprobs = jnp.einsum("btkgd,bskd->bkgts", _finite_or_zero(dout_g), _finite_or_zero(v),
                      preferred_element_type=acc_dtype).astype(acc_dtype)
  finite_pairs = (jnp.moveaxis(_rows_finite(dout_g), 1, -1)[..., None]
                  & jnp.moveaxis(_rows_finite(v), 1, -1)[:, :, None, None, :])
  dprobs = jnp.where(finite_pairs, dprobs, jnp.nan)
  dscores = jnp.where(keep, probs * (dprobs - delta) * slope, 0.0)
  as_acc = lambda x: _finite_or_zero(x).astype(acc_dtype)
  dq = scale * jnp.einsum("bkgts,bskh->btkgh", dscores, as_acc(k))
  dk = scale * jnp.einsum("bkgts,btkgh->bskh", dscores, as_acc(grouped(q)))
  dv = jnp.einsum("bkgts,btkgd->bskd", probs, as_acc(dout_g))
  # A NaN or Inf in a row of dout reaches the dv rows of the keys its row
  # sees (as it does in the CPU kernels).
  dout_seen = jnp.einsum("bts,btk->bsk",
                         jnp.broadcast_to(visible[:, 0], (batch, seq_q, seq_k)).astype(jnp.float32),
                         (~_rows_finite(dout_g)).any(axis=-1).astype(jnp.float32)) > 0
  dv = jnp.where(dout_seen[..., None], jnp.nan, dv)
  unflat = lambda x, dtype: x.reshape(*lead, *x.shape[1:]).astype(dtype)
  return (unflat(dq.reshape(batch, seq_q, heads_q, head_dim), acc_dtype), unflat(dk, k.dtype),
          unflat(dv, v.dtype))
