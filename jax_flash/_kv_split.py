"""Split-KV forward (FlashDecoding) for problems with few query tiles.

A decoding step has one query tile per (batch, kv head) once the query heads
are packed, which leaves most of the GPU idle while each CTA streams the
whole K/V sequence. Cutting the keys into ``parts`` chunks that run as extra
batch entries of one kernel call multiplies the CTAs; the chunks' partial
results merge by their log-sum-exps. Only the forward splits: the backward
kernel takes the merged lse, which is the whole problem's.

A split needs a problem in which every query row sees every key (the rows of
a chunk index no longer match the diagonal) and no segment ids. The chunks
are a reshape of K/V (no copy), so ``parts`` divides seq_k, and their number
follows the grid size: a sequence's output may differ in its last bits with
the batch it runs in (run to run it repeats exactly).

With ``batch_invariant`` the split no longer follows the grid. On Hopper
(``fixed_split_forward``) the cache, viewed as 16-token pages (a reshape:
seq_k a multiple of 16), goes through the paged kernel, which splits every
``KEYS_PER_SPLIT`` keys of each sequence's own length, and the splits merge
in a fixed order (``paged.merge_splits``): the result is bitwise that of
``paged_attention`` on the same cache, whatever else is in the batch and
however long the cache buffer is. Elsewhere the keys are not split. Either
costs speed where the grid split would have filled the GPU (docs/history-serving.md:
the measurements). In both paths the partial outputs are rounded to the
input dtype before the merge.
"""

import math

import jax
import jax.numpy as jnp

from jax_flash import _configs as configs
from jax_flash._call import MaskOperands, sink_operand

# Grid splits (H100, bench_decode.py, batch 8, 32 / 4 heads, hd128; the
# numbers in docs/history-serving.md, "Decoding"): from 1024 keys a split step beat
# the whole one (1k: 0.0107 against 0.0133 ms), 128-key chunks were no
# faster than 256, and aiming at one wave of CTAs beat two and half a wave:
# each CTA streams its chunk from one prologue, so fewer, longer CTAs win
# while they fill the GPU.
MIN_KEYS_TO_SPLIT = 1024
MIN_CHUNK = 256
MAX_PARTS = 32

# Keys per split of the batch-invariant path: paged_attention's default
# kv_split_size, so that a contiguous cache and the same cache in pages give
# bitwise the same results (the sweep behind it: docs/history-serving.md).
KEYS_PER_SPLIT = 4096
# The paged kernel's page granularity (cuda_src/fwd_sm90: paged_kv.PAGE_BOX).
PAGE_ROWS = 16


def fixed_split_applies(q_shape: tuple, k_shape: tuple, head_dim_v: int, dtype, call, *,
                        has_segments: bool, hopper: bool) -> bool:
  """Whether a forward call on these shapes (q's after head packing, V's
  head dim as the kernel gets it) runs on ``fixed_split_forward``: a short
  query (one tile of rows) on Hopper whose rows all see every key. Only the
  batch size decides beyond the shape of one sequence, and only past the
  grid's limit (65535 sequences x splits)."""
  if not (call.batch_invariant and hopper and call.backend == "gpu") or len(q_shape) != 4 or (
      has_segments):
    return False
  from jax_flash import _paged as paged  # paged imports api, which imports this module

  batch, seq_q = q_shape[:2]
  seq_k = k_shape[1]
  splits = -(-seq_k // KEYS_PER_SPLIT)
  return (batch * splits <= configs.MAX_GRID_YZ
          and 0 < seq_q < configs.BACKENDS["gpu"].query_tile_rows and seq_k % PAGE_ROWS == 0
          and seq_k > 0 and call.mask.all_keys_visible(seq_q, seq_k)
          and paged._CUDA_REGISTERED and dtype in (jnp.float16, jnp.bfloat16)
          and q_shape[-1] == head_dim_v in configs.PAGED_HEAD_DIMS)


def fixed_split_forward(q, k, v, masks, call):
  """The forward of ``fixed_split_applies`` calls: (out, lse) as the whole
  forward gives them (rows past ``q_lens`` zero, lse ``-inf``)."""
  from jax_flash import _paged as paged

  batch, seq_q = q.shape[:2]
  seq_k, heads_kv = k.shape[1:3]
  pages_per_row = seq_k // PAGE_ROWS
  as_pages = lambda x: x.reshape(batch * pages_per_row, PAGE_ROWS, heads_kv, x.shape[-1])
  table = jnp.arange(batch * pages_per_row, dtype=jnp.int32).reshape(batch, pages_per_row)
  q_lens = jnp.clip(jnp.asarray(masks.q_lens, jnp.int32), 0, seq_q)
  kv_lens = jnp.clip(jnp.asarray(masks.kv_lens, jnp.int32), 0, seq_k)
  out, lse = paged._paged_kernel(q, as_pages(k), as_pages(v), table, kv_lens, q_lens,
                                scale=call.scale, softcap=call.softcap, window_left=-1,
                                window_right=-1, split_keys=KEYS_PER_SPLIT, partitioned=False)
  padding = jnp.arange(seq_q)[None, None, :] >= q_lens[:, None, None]
  return out, jnp.where(padding, -jnp.inf, lse)


def parts(q_shape: tuple, k_shape: tuple, call, *, has_segments: bool, target_ctas: int) -> int:
  """How many key chunks a forward call on these shapes (q's after head
  packing) runs as (1: no split), aiming at ``target_ctas`` CTAs (0: never
  split)."""
  if not target_ctas or call.batch_invariant or len(q_shape) != 4 or has_segments:
    return 1
  batch, seq_q, heads_q, _ = q_shape
  seq_k = k_shape[1]
  if seq_k < MIN_KEYS_TO_SPLIT or not call.mask.all_keys_visible(seq_q, seq_k):
    return 1
  tile_rows = configs.BACKENDS[call.backend].query_tile_rows
  ctas = math.ceil(seq_q / max(tile_rows, 1)) * heads_q * batch
  wanted = min(math.ceil(target_ctas / max(ctas, 1)), seq_k // MIN_CHUNK, MAX_PARTS)
  # The largest divisor of seq_k not above the wanted count.
  return max((n for n in range(1, wanted + 1) if seq_k % n == 0), default=1)


def split_forward(kernel_forward, q, k, v, masks, call, n: int):
  """``kernel_forward(q, k, v, masks, sinks, call)`` (the unsplit forward)
  over ``n`` key chunks, merged; ``masks`` hold lengths only (the caller
  adds any sinks to the merged result)."""
  batch, seq_q = q.shape[:2]
  seq_k = k.shape[1]
  chunk = seq_k // n
  as_chunks = lambda x: x.reshape(batch * n, chunk, *x.shape[2:])
  q_rep = jnp.broadcast_to(q[:, None], (batch, n, *q.shape[1:])).reshape(batch * n, *q.shape[1:])
  starts = jnp.arange(n, dtype=jnp.int32) * chunk
  chunk_lens = jnp.clip(masks.kv_lens[:, None] - starts[None], 0, chunk).reshape(batch * n)
  chunk_masks = MaskOperands.build((batch * n,), jnp.repeat(masks.q_lens, n), chunk_lens)
  out, lse = kernel_forward(q_rep, as_chunks(k), as_chunks(v), chunk_masks,
                            sink_operand(None, q_rep), call)
  out = out.reshape(batch, n, *out.shape[1:])
  lse = lse.reshape(batch, n, *lse.shape[1:])  # [B, n, N, T]
  total = jax.nn.logsumexp(lse, axis=1)
  safe = jnp.where(jnp.isfinite(total), total, 0.0)
  weights = jnp.swapaxes(jnp.exp(lse - safe[:, None]), -1, -2)[..., None]  # [B, n, T, N, 1]
  merged = jnp.sum(out.astype(jnp.float32) * weights, axis=1)
  return merged.astype(q.dtype), total
