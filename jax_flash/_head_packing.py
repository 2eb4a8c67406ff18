"""GQA query-head packing for short query sequences.

A kernel tile holds ``query_tile_rows`` query rows of one head. With fewer
queries than that (decoding, short chunks) most of each tile is empty, and
every query head of a GQA group reads the same K/V again. Packing the group's
heads into the rows of one sequence (row ``t * group + g`` holds query ``t``
of head ``g`` of the group) fills the tile and reads K/V once per group.

It happens around each kernel call (``_kernels.forward`` / ``backward``, as
``_plan`` decides), that is per shard: sharding, residuals and gradients keep the caller's
layout. The kernels mask by row index, so a packed problem must not depend
on it: packing applies only when every query row sees every key under the
diagonal and window (one decoding query under a causal mask does); lengths
and segment ids carry over row by row.
"""

import dataclasses

import jax.numpy as jnp

from jax_flash import _configs as configs
from jax_flash._call import MaskOperands


def group(q_shape: tuple, k_shape: tuple, call) -> int:
  """The GQA group size to pack for a kernel call on these shapes, or 1 for none."""
  if len(q_shape) != 4:
    return 1
  seq_q, heads_q = q_shape[1:3]
  seq_k, heads_kv = k_shape[1:3]
  size = heads_q // heads_kv
  if size == 1 or seq_q == 0 or seq_q >= configs.BACKENDS[call.backend].query_tile_rows:
    return 1
  return size if call.mask.all_keys_visible(seq_q, seq_k) else 1


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


def pack_masks(masks: MaskOperands, size: int) -> MaskOperands:
  """The mask operands for packed rows: lengths and positions scale by
  ``size``, per-row values repeat."""
  masks = dataclasses.replace(masks, q_lens=masks.q_lens * size)
  if not masks.has_segments:
    return masks
  # Packed documents (kernel_api.h: bounds as [first, last) pairs).
  pairs = masks.kv_bounds.reshape(*masks.kv_bounds.shape[:-1], -1, 2)
  return dataclasses.replace(
      masks, q_ids=jnp.repeat(masks.q_ids, size, axis=-1),
      kv_bounds=jnp.repeat(pairs, size, axis=-2).reshape(*masks.kv_bounds.shape[:-1], -1),
      q_bounds=masks.q_bounds * size)
