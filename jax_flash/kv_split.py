"""Split-KV forward (FlashDecoding) for problems with few query tiles.

A decoding step has one query tile per (batch, kv head) once the query heads
are packed, which leaves most of the GPU idle while each CTA streams the
whole K/V sequence. Cutting the keys into ``parts`` chunks that run as extra
batch entries of one kernel call multiplies the CTAs; the chunks' partial
results merge by their log-sum-exps. Only the forward splits: the backward
kernel takes the merged lse, which is the whole problem's.

The chunks are a reshape of K/V (no copy), so ``parts`` divides seq_k. A
split needs a problem in which every query row sees every key (the rows of a
chunk index no longer match the diagonal) and no segment ids. The partial
outputs are rounded to the input dtype before the merge, and the number of
chunks follows the grid size: a sequence's output may differ in its last
bits with the batch it runs in (run to run it repeats exactly).
"""

import math

import jax
import jax.numpy as jnp

from jax_flash import configs

# Measured on H100 (bench_decode.py, batch 8, 32 query / 4 kv heads, hd128)
# as GPU time per step of 16 dependent steps in one call (results run 87):
# splitting from 1024 keys on, batch 8 at 1k / 2k keys took 0.0107 / 0.0128
# ms against 0.0133 / 0.0215 unsplit, batch 1 0.0094 / 0.0105 against 0.0125
# / 0.0207; 128-key chunks were no faster than 256. (Runs 9-10 timed one
# step per call, where the merge's extra launches showed as host time, and
# kept caches under 4096 keys whole.)
# The chunk count aims at configs' kv_split_ctas CTAs. The same timing
# (results run 85), batch 8 at 4k / 16k / 64k keys: 0.0317 / 0.1014 / 0.3654
# ms aiming at one wave (132 CTAs) against 0.0339 / 0.1025 / 0.3804 at two
# and 0.0329 / 0.1034 / 0.3905 at half a wave; batch 4 with 64 / 8 heads
# 0.0312 / 0.0992 / 0.3639 against 0.0350 / 0.1010 / 0.3653 at two waves.
# Each CTA streams its chunk from one prologue, so fewer, longer CTAs win
# while they fill the GPU.
MIN_KEYS_TO_SPLIT = 1024
MIN_CHUNK = 256
MAX_PARTS = 32


def parts(q, k, call, has_segments: bool) -> int:
  """How many key chunks this forward call runs as (1: no split)."""
  target = configs.BACKENDS[call.backend].kv_split_ctas
  if not target or q.ndim != 4 or has_segments:
    return 1
  batch, seq_q, heads_q, _ = q.shape
  seq_k = k.shape[1]
  if seq_k < MIN_KEYS_TO_SPLIT:
    return 1
  left_free = call.window_left < 0 or call.window_left >= seq_q - 1 + call.diag_offset
  right_free = call.window_right < 0 or call.diag_offset + call.window_right >= seq_k - 1
  if not (left_free and right_free):
    return 1
  tile_rows = configs.BACKENDS[call.backend].query_tile_rows
  ctas = math.ceil(seq_q / max(tile_rows, 1)) * heads_q * batch
  wanted = min(math.ceil(target / max(ctas, 1)), seq_k // MIN_CHUNK, MAX_PARTS)
  # The largest divisor of seq_k not above the wanted count.
  return max((n for n in range(1, wanted + 1) if seq_k % n == 0), default=1)


def split_forward(kernel_forward, q, k, v, q_lens, kv_lens, no_segments, call, n: int):
  """``kernel_forward`` (ffi's unsplit forward) over ``n`` key chunks, merged."""
  batch, seq_q = q.shape[:2]
  seq_k = k.shape[1]
  chunk = seq_k // n
  as_chunks = lambda x: x.reshape(batch * n, chunk, *x.shape[2:])
  q_rep = jnp.broadcast_to(q[:, None], (batch, n, *q.shape[1:])).reshape(batch * n, *q.shape[1:])
  starts = jnp.arange(n, dtype=jnp.int32) * chunk
  chunk_lens = jnp.clip(kv_lens[:, None] - starts[None], 0, chunk).reshape(batch * n)
  out, lse = kernel_forward(q_rep, as_chunks(k), as_chunks(v), jnp.repeat(q_lens, n),
                            chunk_lens, *no_segments, call)
  out = out.reshape(batch, n, *out.shape[1:])
  lse = lse.reshape(batch, n, *lse.shape[1:])  # [B, n, N, T]
  total = jax.nn.logsumexp(lse, axis=1)
  safe = jnp.where(jnp.isfinite(total), total, 0.0)
  weights = jnp.swapaxes(jnp.exp(lse - safe[:, None]), -1, -2)[..., None]  # [B, n, T, N, 1]
  merged = jnp.sum(out.astype(jnp.float32) * weights, axis=1)
  return merged.astype(q.dtype), total
