"""Packed documents: segment ids, the bounds the kernels skip tiles with, and
the conversion from FlashAttention-style varlen offsets."""

import jax
import jax.numpy as jnp

# Ids given to tokens past the last varlen offset: different for queries and
# keys, so padding never attends to padding.
_QUERY_PADDING_ID = -1
_KEY_PADDING_ID = -2


def _bounds_one_row(ids, other_ids):
  """For each entry of ``ids``: [first, last + 1) of the positions in
  ``other_ids`` holding the same id, [0, 0) when none do."""
  positions = jnp.arange(other_ids.shape[0], dtype=jnp.int32)
  # Sorting (id, position) pairs puts each id's positions in one ascending run.
  sorted_ids, sorted_positions = jax.lax.sort((other_ids, positions), num_keys=2)
  # Unrolled searches: XLA checks a GPU while loop's condition on the host,
  # one round trip per step.
  lo = jnp.searchsorted(sorted_ids, ids, side="left", method="scan_unrolled")
  hi = jnp.searchsorted(sorted_ids, ids, side="right", method="scan_unrolled")
  found = hi > lo
  last_index = other_ids.shape[0] - 1
  first = sorted_positions[jnp.minimum(lo, last_index)]
  last = sorted_positions[jnp.clip(hi - 1, 0, last_index)] + 1
  return jnp.stack([jnp.where(found, first, 0), jnp.where(found, last, 0)], axis=-1)


def segment_bounds(q_segment_ids, kv_segment_ids):
  """(kv_bounds [B, T, 2], q_bounds [B, S, 2]) as kernel_api.h defines them."""
  kv_bounds = jax.vmap(_bounds_one_row)(q_segment_ids, kv_segment_ids)
  q_bounds = jax.vmap(_bounds_one_row)(kv_segment_ids, q_segment_ids)
  return kv_bounds.astype(jnp.int32), q_bounds.astype(jnp.int32)


def segment_ids_from_offsets(cu_seqlens, total: int, padding_id: int):
  """Document index of each of ``total`` packed tokens; ``padding_id`` past
  the last offset."""
  positions = jnp.arange(total, dtype=jnp.int32)
  ids = jnp.searchsorted(cu_seqlens[1:], positions, side="right", method="scan_unrolled")
  ids = ids.astype(jnp.int32)
  return jnp.where(positions < cu_seqlens[-1], ids, jnp.int32(padding_id))


def varlen_segment_ids(cu_seqlens_q, total_q: int, cu_seqlens_k, total_k: int):
  return (segment_ids_from_offsets(cu_seqlens_q, total_q, _QUERY_PADDING_ID),
          segment_ids_from_offsets(cu_seqlens_k, total_k, _KEY_PADDING_ID))
