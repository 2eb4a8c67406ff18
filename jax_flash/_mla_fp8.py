"""The latent cache formats of ``jax_flash.mla_decode`` and their XLA maths.

An MLA (DeepSeek-V2/V3) cache holds one 576-wide row per token: 512 latent
columns, which serve as both key and value, and 64 RoPE columns, which serve
only as key. Two formats:

* bfloat16 / float16: ``[num_pages, 64, 576]``, the row as it is.
* FP8, RoPE-aware per token (the scheme of SnapMLA): ``MlaFp8Cache``, the
  latent in float8_e4m3fn with one float32 scale per token from its amax,
  the RoPE part kept in bfloat16 beside it. RoPE columns reach ~1e3 where the
  latent sits near 0 (docs/mla.md), so one scale over all 576 columns would
  leave the latent a few of e4m3's codes, or none.

The FP8 reference (``fp8_reference``) computes what the Hopper kernel does:
queries quantised the same way per token and head; ``Q K^T`` as the FP8
latent product with both scales applied, plus the bfloat16 RoPE product, in
one float32 accumulator; ``P V`` against the raw e4m3 latent with the
keys' scales folded into ``P``, which is requantised to e4m3 per query row
and key block (one page: the kernel's key tile) with its own scale.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flash import _paged as paged

LATENT_DIM = 512
ROPE_DIM = 64
HEAD_DIM = LATENT_DIM + ROPE_DIM
# Tokens per page: the kernel's key tile is one page (one TMA box per operand).
PAGE_SIZE = 64
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
MIN_SCALE = 2.0 ** -126  # the smallest normal float32: a scale's inverse stays finite
ROPE_DTYPE = jnp.dtype(jnp.bfloat16)
# Keys per requantisation block of P: the kernel's key tile.
P_BLOCK_KEYS = PAGE_SIZE
# Columns per group when a cache write views a token's row as heads
# (write_token_rows); it divides 576, 512 and 64.
_WRITE_GROUP = 32


class MlaFp8Cache(NamedTuple):
  """The FP8 latent cache: token ``i`` of page ``p`` is
  ``concat(latent[p, i] * scales[p, i], rope[p, i])``.

  Three arrays rather than one packed byte row: each is a plain strided
  tensor whose rows are 16-byte multiples (512, 128 bytes; a page's 64
  scales 256 bytes), so the kernel loads one page of each with one TMA box
  into its own shared-memory tile, each with the swizzle its GEMM operand
  wants, and XLA reads and writes them as typed arrays. 644 bytes per token
  (bfloat16: 1152).

  Attributes:
    latent: float8_e4m3fn ``[num_pages, 64, 512]``, the latent divided by
      its scale.
    scales: float32 ``[num_pages, 64]``, each token's ``amax * (1 / 448)`` (1 for
      an all-zero latent).
    rope: bfloat16 ``[num_pages, 64, 64]``, the RoPE columns unscaled.
  """
  latent: jax.Array
  scales: jax.Array
  rope: jax.Array


def quantize_rows(x):
  """``(values, scales)`` with ``x ~= values * scales[..., None]``: each row
  (last axis) in float8_e4m3fn, its largest magnitude mapped to about 448.

  ``scale = max(amax * (1 / 448), 2^-126)`` (1 for a zero row; the smallest
  normal float32 keeps ``1 / scale`` finite for rows of tiny values, such as
  the attention weights of keys far below a row's maximum) and ``values =
  e4m3(x * (1 / scale))``, saturating, rounding to nearest even: each step
  one IEEE float32 operation, written as XLA would rewrite a division by a
  constant or a broadcast anyway, so that XLA on any platform, numpy and a
  kernel (``rcp.rn``, ``cvt.rn.satfinite``) produce the same bits (for
  inputs without subnormal values, which XLA may flush to zero). A NaN in a
  row makes that row's values NaN."""
  x = jnp.asarray(x, jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=-1)
  scales = jnp.where(amax > 0, jnp.maximum(amax * jnp.float32(1 / FP8_MAX), MIN_SCALE), 1.0)
  inverse = 1 / scales
  values = jnp.clip(x * inverse[..., None], -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
  return values, scales


def quantize_latent(x):
  """Splits rows ``[..., 576]`` into ``(latent e4m3 [..., 512], scales
  float32 [...], rope bfloat16 [..., 64])``: the cache's format for tokens,
  and the queries' (per token and head) on the FP8 path."""
  if jnp.shape(x)[-1] != HEAD_DIM:
    raise ValueError(f"rows to quantise must be {HEAD_DIM} wide ({LATENT_DIM} latent + "
                     f"{ROPE_DIM} RoPE), got shape {jnp.shape(x)}")
  latent, scales = quantize_rows(x[..., :LATENT_DIM])
  return latent, scales, x[..., LATENT_DIM:].astype(ROPE_DTYPE)


def dequantize_latent(latent, scales, rope):
  """Float32 rows ``[..., 576]`` from the three parts of the FP8 format."""
  values = latent.astype(jnp.float32) * scales[..., None]
  return jnp.concatenate([values, rope.astype(jnp.float32)], axis=-1)


def empty_fp8_cache(num_pages: int) -> MlaFp8Cache:
  return MlaFp8Cache(jnp.zeros((num_pages, PAGE_SIZE, LATENT_DIM), FP8_DTYPE),
                     jnp.ones((num_pages, PAGE_SIZE), jnp.float32),
                     jnp.zeros((num_pages, PAGE_SIZE, ROPE_DIM), ROPE_DTYPE))


def requantize_blocks(p):
  """``p`` ``[..., keys]`` (a multiple of ``P_BLOCK_KEYS``) rounded as the
  kernel's P operand: per block of keys, e4m3 with scale ``amax / 448``;
  returns the float32 values the FP8 GEMM multiplies (value times scale)."""
  blocks = p.reshape(*p.shape[:-1], -1, P_BLOCK_KEYS)
  values, scales = quantize_rows(blocks)
  return (values.astype(jnp.float32) * scales[..., None]).reshape(p.shape)


def visible_keys(cache_lengths, query_lengths, max_new: int, max_keys: int):
  """Bool ``[batch, max_new, max_keys]``: query row ``t`` of sequence ``b``
  is token ``cache_lengths[b] - query_lengths[b] + t`` and sees the cache up
  to itself (paged_attention's bottom-right causal rule). Lengths clip to
  the table, as inside jit in paged_attention."""
  lengths = jnp.clip(cache_lengths, 0, max_keys)
  q_lens = jnp.clip(query_lengths, 0, max_new)
  row = jnp.arange(max_new)[None, :, None]
  position = (lengths - q_lens)[:, None, None] + row
  key = jnp.arange(max_keys)[None, None]
  return (key < lengths[:, None, None]) & (row < q_lens[:, None, None]) & (key <= position)


def gather_pages(pages, page_table):
  """``pages [num_pages, page_size, ...]`` gathered per sequence into
  ``[batch, max_pages * page_size, ...]``; a page id outside the pool reads
  zeros (paged_attention's rule inside jit)."""
  num_pages = pages.shape[0]
  batch, max_pages = page_table.shape
  ids = jnp.where((page_table >= 0) & (page_table < num_pages), page_table, num_pages)
  gathered = jnp.take(pages, ids, axis=0, mode="fill", fill_value=0)
  return gathered.reshape(batch, max_pages * pages.shape[1], *pages.shape[2:])


def _finite_or_zero(x):
  return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


def fp8_reference(q, cache: MlaFp8Cache, page_table, cache_lengths, query_lengths, *,
                  scale: float, requantize_p: bool = True):
  """MLA decoding against the FP8 cache in XLA: ``(out [batch, max_new,
  heads, 512] in q's dtype, lse float32 [batch, heads, max_new])``.

  With query row ``q = (q_lat * sq, q_rope)`` (``quantize_latent``, per
  token and head) and cached token ``k = (k_lat * sk, k_rope)``:

    logit = scale * (sq * sk * (q_lat . k_lat) + q_rope . k_rope)
    P = exp(logit - rowmax),  l = sum(P),  lse = rowmax + log(l)
    out = sum_j sp_j * (e4m3(P * sk / sp_j) . k_lat) / l

  where ``sp_j`` is the requantisation scale of row ``P * sk`` over key
  block ``j`` (``requantize_blocks``). The kernel carries ``sp_j`` in its
  online softmax: the per-block scale is scale invariant, so quantising
  against the running maximum gives the codes of the final one, up to
  float32 rounding. The products here run in float32 (the kernel's order
  and its FP8 tensor cores' accumulation differ at float32 rounding).
  ``requantize_p=False`` keeps ``P`` in float32 and multiplies it by the
  dequantised latent: the error of the cache's (and queries') quantisation
  alone.

  A NaN or Inf in a visible token's row, or in a query row, makes that query
  row NaN (V is part of K); nothing a row does not see reaches it."""
  batch, max_new, heads, _ = q.shape
  max_keys = page_table.shape[1] * PAGE_SIZE
  k_latent = gather_pages(cache.latent, page_table).astype(jnp.float32)
  k_scales = gather_pages(cache.scales, page_table)
  k_rope = gather_pages(cache.rope, page_table).astype(jnp.float32)
  q_latent, q_scales, q_rope = quantize_latent(q)
  q_latent, q_rope = q_latent.astype(jnp.float32), q_rope.astype(jnp.float32)
  q_ok = jnp.all(jnp.isfinite(q_latent), -1) & jnp.isfinite(q_scales) & jnp.all(
      jnp.isfinite(q_rope), -1)  # [B, T, H]
  k_ok = jnp.all(jnp.isfinite(k_latent), -1) & jnp.isfinite(k_scales) & jnp.all(
      jnp.isfinite(k_rope), -1)  # [B, S]
  k_latent, k_scales, k_rope = map(_finite_or_zero, (k_latent, k_scales, k_rope))
  row_scales = jnp.moveaxis(_finite_or_zero(q_scales), 1, 2)[..., None]  # [B, H, T, 1]
  visible = visible_keys(cache_lengths, query_lengths, max_new, max_keys)[:, None]
  # Float32 products, also where XLA would take TF32.
  with jax.default_matmul_precision("highest"):
    latent_dot = jnp.einsum("bthd,bsd->bhts", _finite_or_zero(q_latent), k_latent)
    rope_dot = jnp.einsum("bthd,bsd->bhts", _finite_or_zero(q_rope), k_rope)
    logits = (latent_dot * row_scales * k_scales[:, None, None] + rope_dot) * jnp.float32(scale)
    finite = jnp.isfinite(logits) & jnp.moveaxis(q_ok, 1, 2)[..., None] & k_ok[:, None, None]
    logits = jnp.where(visible, jnp.where(finite, logits, jnp.nan), -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # NaN if a visible logit is
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    seen = total != 0  # NaN included
    safe_total = jnp.where(seen, total, 1.0)
    if requantize_p:
      p, values = requantize_blocks(weights * k_scales[:, None, None]), k_latent
    else:
      p, values = weights, k_latent * k_scales[..., None]
    out = jnp.einsum("bhts,bsd->bhtd", p, values) / safe_total
  lse = jnp.where(seen, row_max + jnp.log(safe_total), -jnp.inf)[..., 0]
  return jnp.moveaxis(out, 1, 2).astype(q.dtype), lse


def write_fp8_cache(cache: MlaFp8Cache, latent, page_table, cache_lengths, query_lengths):
  """Quantises ``latent [batch, max_new, 576]`` per token and writes it
  where ``paged.write_paged_cache`` writes a token; returns the new cache."""
  values, scales, rope = quantize_latent(latent)
  new_latent, new_rope = write_token_rows((cache.latent, cache.rope), (values, rope), page_table,
                                          cache_lengths, query_lengths)
  (new_scales,) = write_token_rows((cache.scales,), (scales,), page_table, cache_lengths,
                                   query_lengths)
  return MlaFp8Cache(new_latent, new_scales, new_rope)


def write_token_rows(pools, rows, page_table, cache_lengths, query_lengths):
  """``paged.write_paged_cache`` for one or two pools holding one row (or
  one value) per token, ``[num_pages, 64, ...]``, and their new tokens'
  ``rows [batch, max_new, ...]``; returns the new pools.

  A row goes to write_paged_cache as groups of 32 columns (its "heads"):
  XLA:CPU copies a pool around its scatter when the pool has an axis of
  one, which one kv head would give (the scales, one value per token, go
  as one head of one: their copy is 1/161 of the FP8 cache). A single pool
  goes as both halves of write_paged_cache's (k, v) pair, and under jit XLA
  drops the unused second write."""
  def as_heads(x, lead):
    tail = x.shape[lead:]
    return x.reshape(*x.shape[:lead], *((tail[0] // _WRITE_GROUP, _WRITE_GROUP) if tail
                                        else (1, 1)))
  heads = [(as_heads(pool, 2), as_heads(new, 2)) for pool, new in zip(pools, rows)]
  (k_pages, k), (v_pages, v) = heads if len(heads) == 2 else heads * 2
  written = paged.write_paged_cache(k_pages, v_pages, k, v, page_table, cache_lengths,
                                    query_lengths)
  return tuple(new.reshape(pool.shape) for new, pool in zip(written, pools))
