"""GQA query-head packing for short query sequences.

A kernel tile holds ``query_tile_rows`` query rows of one head. With fewer
queries than that (decoding, short chunks) most of each tile is empty, and
every query head of a GQA group reads the same K/V again. Packing the group's
heads into the rows of one sequence (row ``t * group + g`` holds query ``t``
of head ``g`` of the group) fills the tile and reads K/V once per group.

It happens around each kernel call (``ffi.forward`` / ``ffi.backward``),
that is per shard: sharding, residuals and gradients keep the caller's
layout. The kernels mask by row index, so a packed problem must not depend
on it: packing applies only when every query row sees every key under the
diagonal and window (one decoding query under a causal mask does); lengths
and segment ids carry over row by row.
"""

import dataclasses

import jax.numpy as jnp

from jax_flash import _configs as configs


def group(q, k, call) -> int:
  """The GQA group size to pack for this kernel call, or 1 for none."""
  if q.ndim != 4:
    return 1
  seq_q, heads_q = q.shape[1:3]
  seq_k, heads_kv = k.shape[1:3]
  size = heads_q // heads_kv
  if size == 1 or seq_q == 0 or seq_q >= configs.BACKENDS[call.backend].query_tile_rows:
    return 1
  return size if all_keys_visible(seq_q, seq_k, call) else 1


def all_keys_visible(seq_q: int, seq_k: int, call) -> bool:
  """Whether every query row sees every key under ``call``'s diagonal and
  window (row i sees keys [i + diag_offset - window_left, i + diag_offset +
  window_right])."""
  left_free = call.window_left < 0 or call.window_left >= seq_q - 1 + call.diag_offset
  right_free = call.window_right < 0 or call.diag_offset + call.window_right >= seq_k - 1
  return left_free and right_free


def unmasked(call):
  """``call`` for the packed rows: their keys are all visible."""
  return dataclasses.replace(call, diag_offset=0, window_left=-1, window_right=-1)


def pack_rows(x, size: int):
  """[B, T, Hkv * size, D] -> [B, T * size, Hkv, D]."""
  batch, seq, heads, dim = x.shape
  x = x.reshape(batch, seq, heads // size, size, dim).transpose(0, 1, 3, 2, 4)
  return x.reshape(batch, seq * size, heads // size, dim)


def unpack_rows(x, size: int):
  """Inverse of ``pack_rows``."""
  batch, rows, heads_kv, dim = x.shape
  x = x.reshape(batch, rows // size, size, heads_kv, dim).transpose(0, 1, 3, 2, 4)
  return x.reshape(batch, rows // size, heads_kv * size, dim)


def pack_stats(x, size: int):
  """Per-row statistics [B, Hkv * size, T] -> [B, Hkv, T * size]."""
  batch, heads, seq = x.shape
  x = x.reshape(batch, heads // size, size, seq).transpose(0, 1, 3, 2)
  return x.reshape(batch, heads // size, seq * size)


def unpack_stats(x, size: int):
  """Inverse of ``pack_stats``."""
  batch, heads_kv, rows = x.shape
  x = x.reshape(batch, heads_kv, rows // size, size).transpose(0, 1, 3, 2)
  return x.reshape(batch, heads_kv * size, rows // size)


def pack_masks(q_lens, q_ids, kv_bounds, q_bounds, size: int):
  """The row-indexed mask operands of ``ffi.forward`` for packed rows:
  lengths and positions scale by ``size``, per-row values repeat."""
  q_lens = q_lens * size
  if q_ids.shape[-1]:  # packed documents (kernel_api.h: bounds as [first, last) pairs)
    q_ids = jnp.repeat(q_ids, size, axis=-1)
    pairs = kv_bounds.reshape(*kv_bounds.shape[:-1], -1, 2)
    kv_bounds = jnp.repeat(pairs, size, axis=-2).reshape(*kv_bounds.shape[:-1], -1)
    q_bounds = q_bounds * size
  return q_lens, q_ids, kv_bounds, q_bounds
