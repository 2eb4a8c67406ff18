"""Attention against a paged KV cache, for serving: decode steps, speculative
tokens and chunked prefill in one ragged batch.

The cache is a pool of pages shared by all sequences, ``[num_pages,
page_size, heads_kv, head_dim]``; a page table row lists the pages of one
sequence in order. This is the layout of vLLM and FlashAttention: one token's
keys for every head are one contiguous row (a cache write is one row per
token), and the kernel reads a page's keys of one head as a strided box.

Results are batch invariant on the GPU kernels: the keys of a sequence are
cut into splits of a fixed number of keys (``kv_split_size``), never into a
number of splits chosen from the grid, and the splits' partial results merge
in a fixed order (``merge_splits``) in which a split without visible keys
changes nothing. A sequence's output is then the same, bit for bit, whatever
else is in the batch, wherever its pages sit in the pool, and whether its
queries come one per step or many per chunk. Two GPU kernels take the same
call (the CUDA handler picks one): the Hopper kernel (``cuda_src/fwd_sm90``,
TMA) on a Hopper GPU for head dims 64, 128 and 256, the sm80 family's
(``cuda_src/fwd_sm80``, cp.async) on compute capability 8.x and for head
dims 96 and 192 on Hopper. The CPU kernel
(``cuda_src/cpu/paged_cpu.cc``) is batch invariant without splitting: one
task runs each sequence's keys whole, in tiles at fixed key offsets.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _cpu_ffi
from jax_flash import _api as api
from jax_flash import _configs as configs
from jax_flash import _ffi as ffi
from jax_flash import _gpu_support
from jax_flash import _paged_fp8 as paged_fp8
from jax_flash import _reference as reference
from jax_flash import _sharding as sharding
from jax_flash import _validation as validation
from jax_flash._call import Mask
from jax_flash._sinks import add_sinks

_PAGED_TARGET = "jax_flash_gpu_paged_fwd_v1"
# The entry points behind it (cuda_src/include/jax_flash/kernel_api.h).
_GPU_KERNELS = ("jax_flash_fwd_sm90_paged", "jax_flash_fwd_sm80_paged")
_CPU_PAGED_TARGET = "jax_flash_cpu_paged_fwd_v1"
# The Hopper kernel fills a key tile from boxes of this many keys, one page
# each (cuda_src/fwd_sm90/paged_kv.py: PAGE_BOX); the sm80 one takes any page
# size, but one rule serves both.
_PAGE_ALIGN = 16
_MAX_PAGE_SIZE = 256
# Keys per split (see kv_split_size): of 1024, 2048 and 4096 the fastest, or
# within 0.2% of it, at every decode shape measured, 2k to 128k keys, batch 1
# to 256, and for 2048-token prefill chunks (H200; docs/history-serving.md).
DEFAULT_KV_SPLIT_SIZE = 4096


_CUDA_REGISTERED = ffi.register_cuda_handler(
    "JaxFlashPagedFwdCuda", _PAGED_TARGET,
    lambda library: any(getattr(library, name, None) for name in _GPU_KERNELS))
for _name, _capsule in _cpu_ffi.paged_registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


def paged_attention(q, k_pages, v_pages, page_table, cache_lengths, *, query_lengths=None,
                    causal: bool = True, window=None, scale: float | None = None,
                    softcap: float | None = None, sinks=None, kv_split_size: int | None = None,
                    return_lse: bool = False, implementation: str | None = None):
  """Attention of new tokens against a paged KV cache (forward only).

  Each sequence ``b`` has ``cache_lengths[b]`` tokens in its cache, the last
  ``query_lengths[b]`` of which are its new tokens, already written
  (``write_paged_cache``): query row ``t`` is token ``cache_lengths[b] -
  query_lengths[b] + t``. A decode step has one new token per sequence, a
  prefill chunk many, and one call may mix them.

  Args:
    q: ``[batch, max_new_tokens, heads_q, head_dim]``; rows past a
      sequence's ``query_lengths`` are padding (zero output, lse ``-inf``).
    k_pages: ``[num_pages, page_size, heads_kv, head_dim]``; ``heads_q`` a
      multiple of ``heads_kv``; ``page_size`` a multiple of 16 up to 256.
      Or an ``Fp8Pages`` (FP8 codes and a float32 scale per token and kv
      head; then ``v_pages`` too, q float32, bfloat16 or float16, the
      output in q's dtype; docs/fp8.md). A Hopper GPU reads such a cache
      in its kernel (float16 / bfloat16 q, head dims 64 and 128); other
      calls dequantise the pages they read first.
    v_pages: ``[num_pages, page_size, heads_kv, head_dim_v]``.
    page_table: int32 ``[batch, max_pages]``: token ``i`` of sequence ``b``
      sits in page ``page_table[b, i // page_size]`` at row ``i %
      page_size``. Entries past a sequence's last page are never read.
    cache_lengths: int32 ``[batch]``, new tokens included. Slots past it
      may hold anything, NaN included: no result depends on them.
    query_lengths: int32 ``[batch]``, the new tokens per sequence;
      ``None``: ``max_new_tokens`` for every sequence.
    causal: a new token sees the cache up to itself (bottom-right); else
      the whole cache.
    window: ``(left, right)`` keys around each token's own position, as in
      ``jax_flash.attention``.
    scale: logit scale, ``1/sqrt(head_dim)`` by default.
    softcap: ``softcap * tanh(logit / softcap)``, as in ``attention``.
    kv_split_size: keys per split of the GPU kernel, a multiple of
      ``page_size``; ``None``: ``DEFAULT_KV_SPLIT_SIZE`` rounded down to
      one. Results are batch invariant for one value of it (the split count
      follows each sequence's own length). Smaller splits give more
      parallelism to short batches; each split of a prefill chunk adds one
      partial output of the chunk's size. The CPU kernel does not split.
    return_lse: also return the natural-log log-sum-exp, float32
      ``[batch, heads_q, max_new_tokens]``.
    sinks: attention sinks, float32 ``[heads_q]``, as in ``attention``
      (folded in after the kernels); rows that see no key, padding rows
      included, then output zeros with an lse equal to their sink.
    implementation: ``None`` runs jax_flash's kernel where one applies
      (GPUs of compute capability 8.x and 9.0: float16 and bfloat16, head
      dims 64, 96, 128, 192 and 256 with ``head_dim_v == head_dim``; CPUs:
      any dtype and head dim up to 512) and the XLA composition elsewhere;
      ``"flash"`` raises
      ``NotImplementedError`` instead of falling back; ``"xla"`` is the
      composition over gathered pages.

  Page ids and lengths are checked when they are concrete; inside ``jit``
  a page id outside the pool reads zeros (nothing outside the pool is
  read) and lengths clip to the table. A NaN or Inf in a position a query
  row sees reaches that row's output (and, in q or k, its lse NaN), as in a
  float32 softmax; nothing a row does not see reaches it. No gradient is
  defined.

  Returns:
    ``out [batch, max_new_tokens, heads_q, head_dim_v]``, or ``(out, lse)``.
  """
  validation.check_implementation(implementation, (None, "flash", "xla"))
  fp8_cache = isinstance(k_pages, paged_fp8.Fp8Pages) or isinstance(v_pages, paged_fp8.Fp8Pages)
  if fp8_cache and _fp8_kernel_unavailable_reason(q, k_pages, v_pages, implementation):
    return _paged_attention_fp8(
        q, k_pages, v_pages, page_table, cache_lengths, query_lengths=query_lengths,
        causal=causal, window=window, scale=scale, softcap=softcap, sinks=sinks,
        kv_split_size=kv_split_size, return_lse=return_lse, implementation=implementation)
  codes = (k_pages.values, v_pages.values) if fp8_cache else (k_pages, v_pages)
  shapes = _check_paged(q, *codes, page_table, cache_lengths, query_lengths, kv_split_size,
                        fp8_cache=fp8_cache)
  scale = validation.check_scale(scale, shapes["head_dim"])
  window = validation.check_window(window, "window")
  visible = Mask.of(causal=validation.check_flag(causal, "causal"), window=window)
  softcap = validation.check_softcap(softcap)
  sinks = validation.check_sinks(sinks, jnp.shape(q)[2])
  batch, max_new = q.shape[:2]
  if query_lengths is None:
    query_lengths = jnp.full((batch,), max_new, jnp.int32)
  cache_lengths = jnp.asarray(cache_lengths, jnp.int32)
  query_lengths = jnp.asarray(query_lengths, jnp.int32)
  page_table = jnp.asarray(page_table, jnp.int32)
  platform = api._platform_of(q)
  mask = dict(scale=scale, softcap=softcap, window_left=visible.window_left,
              window_right=visible.window_right)
  if implementation == "xla":
    attend = functools.partial(paged_attention_reference, **mask)
  elif fp8_cache:  # the Hopper kernel serves it (above)
    attend = functools.partial(_paged_fp8_kernel, split_keys=shapes["split_keys"], **mask)
  else:
    reasons = {"cpu": _kernel_unavailable_reason("cpu", q, shapes),
               "cuda": (_kernel_unavailable_reason("gpu", q, shapes) if platform == "gpu" else
                        _GPU_FROM_ELSEWHERE)}
    local = reasons.get({"gpu": "cuda"}.get(platform, platform),
                        f"jax_flash has no paged kernel for platform {platform!r}")
    if local is not None and implementation == "flash":
      raise NotImplementedError(f"implementation='flash': {local}")
    attend = functools.partial(_per_platform, implementation=implementation, reasons=reasons,
                               split_keys=shapes["split_keys"], **mask)
  if fp8_cache:
    out, lse = sharding.on_explicit_mesh(
        attend, q, (k_pages.values, v_pages.values, k_pages.scales, v_pages.scales), page_table,
        cache_lengths, query_lengths, fp8_scales=True)
  else:
    out, lse = sharding.on_explicit_mesh(attend, q, (k_pages, v_pages), page_table,
                                         cache_lengths, query_lengths)
  return _with_sinks(out, lse, query_lengths, sinks, return_lse)


def _with_sinks(out, lse, query_lengths, sinks, return_lse):
  """A paged call's result with its sinks folded in (``sinks`` None: none)."""
  if sinks is not None:
    # A padding row sees no key, whatever its query left in the kernel's lse.
    padding = jnp.arange(out.shape[1])[None, None, :] >= query_lengths[:, None, None]
    out, lse = add_sinks(out, jnp.where(padding, -jnp.inf, lse), sinks)
  return (out, lse) if return_lse else out


def write_paged_cache(k_pages, v_pages, k, v, page_table, cache_lengths, query_lengths=None):
  """Writes the new tokens' keys and values into their pages.

  ``k`` / ``v`` are ``[batch, max_new_tokens, heads_kv, head_dim(_v)]``;
  row ``t`` of sequence ``b`` goes to token ``cache_lengths[b] -
  query_lengths[b] + t`` (the arguments of ``paged_attention``, so one
  decode step passes the same lengths to both). Rows past
  ``query_lengths[b]`` and tokens whose page id lies outside the pool are
  dropped. Returns the new ``(k_pages, v_pages)``: under ``jit`` with the
  pages donated (``donate_argnums``) XLA writes them in place.

  With ``Fp8Pages`` pools, ``k`` / ``v`` may have any float dtype: each
  token and kv head is quantised (``quantize_fp8``'s rule) and its codes
  and scale written.
  """
  fp8_pools = [isinstance(p, paged_fp8.Fp8Pages) for p in (k_pages, v_pages)]
  if any(fp8_pools):
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
      paged_fp8.check_pages(name, pages)
    (k_codes, k_scales), (v_codes, v_scales) = map(paged_fp8.quantize_tokens, (k, v))
    new_k, new_v = write_paged_cache(k_pages.values, v_pages.values, k_codes, v_codes,
                                     page_table, cache_lengths, query_lengths)
    pages, slots = _token_slots(page_table, cache_lengths, query_lengths, *k_codes.shape[:2],
                                *new_k.shape[:2])
    return (paged_fp8.Fp8Pages(new_k, paged_fp8.write_scales(k_pages.scales, k_scales, pages,
                                                             slots)),
            paged_fp8.Fp8Pages(new_v, paged_fp8.write_scales(v_pages.scales, v_scales, pages,
                                                             slots)))
  for name, new, pages in (("k", k, k_pages), ("v", v, v_pages)):
    if jnp.ndim(new) != 4 or jnp.ndim(pages) != 4 or jnp.shape(new)[2:] != jnp.shape(pages)[2:]:
      raise ValueError(f"{name} must be [batch, max_new_tokens, heads_kv, dim] with the "
                       f"(heads_kv, dim) of its pages {jnp.shape(pages)[2:]}, got shape "
                       f"{jnp.shape(new)}")
    if jnp.result_type(new) != jnp.result_type(pages):
      raise ValueError(f"{name} must have its pages' dtype {jnp.result_type(pages)}, got "
                       f"{jnp.result_type(new)}")
  batch, max_new = jnp.shape(k)[:2]
  if jnp.shape(v)[:2] != (batch, max_new):
    raise ValueError(f"v must have k's leading shape {(batch, max_new)}, got {jnp.shape(v)[:2]}")
  num_pages, page_size = jnp.shape(k_pages)[:2]
  _check_table(page_table, cache_lengths, query_lengths, batch, max_new, num_pages, page_size)
  pages, slots = _token_slots(page_table, cache_lengths, query_lengths, batch, max_new,
                              num_pages, page_size)
  rows = pages * page_size + slots  # dropped tokens: past the pool's last row

  def scatter(pool, new):
    flat = pool.reshape(num_pages * page_size, *pool.shape[2:])
    # The pool keeps its sharding: with sequences sharded over an Explicit
    # mesh axis that the pool is replicated over, every replica takes every
    # sequence's tokens.
    flat = flat.at[rows.reshape(-1)].set(new.reshape(-1, *new.shape[2:]), mode="drop",
                                         unique_indices=False,
                                         out_sharding=jax.typeof(flat).sharding)
    return flat.reshape(pool.shape)

  return scatter(k_pages, k), scatter(v_pages, v)


def _token_slots(page_table, cache_lengths, query_lengths, batch, max_new, num_pages, page_size):
  """``(page, slot)`` int32 ``[batch, max_new]`` of each new token; tokens
  that are not written (padding rows, positions outside the table, page ids
  outside the pool) get page ``num_pages``, past the pool."""
  if query_lengths is None:
    query_lengths = jnp.full((batch,), max_new, jnp.int32)
  positions = (jnp.asarray(cache_lengths, jnp.int32)[:, None]
               - jnp.asarray(query_lengths, jnp.int32)[:, None] + jnp.arange(max_new)[None])
  slot_of_page = jnp.clip(positions // page_size, 0, jnp.shape(page_table)[1] - 1)
  pages = jnp.take_along_axis(jnp.asarray(page_table, jnp.int32), slot_of_page, axis=1)
  written = ((jnp.arange(max_new)[None] < jnp.asarray(query_lengths)[:, None]) & (positions >= 0)
             & (positions < jnp.shape(page_table)[1] * page_size)
             & (pages >= 0) & (pages < num_pages))
  return jnp.where(written, pages, num_pages), positions % page_size


def _fp8_kernel_unavailable_reason(q, k_pages, v_pages, implementation) -> str | None:
  """Why the Hopper kernel cannot read this FP8 cache itself, or None; the
  pools' own checks first."""
  for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
    paged_fp8.check_pages(name, pages)
  if implementation == "xla":
    return "implementation='xla'"
  if api._platform_of(q) != "gpu" or jnp.ndim(q) != 4:
    return "not on a GPU"
  return paged_fp8.kernel_unavailable_reason(jnp.result_type(q), jnp.shape(q)[-1],
                                             jnp.shape(v_pages.values)[-1])


def _paged_attention_fp8(q, k_pages, v_pages, page_table, cache_lengths, *, query_lengths,
                         implementation, sinks, return_lse, **kwargs):
  """paged_attention on ``Fp8Pages``: each sequence's pages gathered and
  dequantised to float32, then the float32 call (the CPU kernel on a CPU,
  the XLA composition elsewhere); out in q's dtype. Sharded, each device
  gathers its own sequences' pages of its own kv heads."""
  for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
    paged_fp8.check_pages(name, pages)
  if jnp.ndim(q) != 4:
    raise ValueError("q must have rank 4 [batch, max_new_tokens, heads_q, head_dim], got shape "
                     f"{jnp.shape(q)}")
  dtype = jnp.result_type(q)
  if dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
    raise ValueError(f"q must be float32, bfloat16 or float16 with an FP8 cache, got {dtype}")
  if implementation == "flash" and api._platform_of(q) == "gpu":
    reason = paged_fp8.kernel_unavailable_reason(dtype, jnp.shape(q)[-1],
                                                 jnp.shape(v_pages.values)[-1])
    raise NotImplementedError(f"implementation='flash': {reason}; implementation=None runs the "
                              "XLA composition")
  num_pages, page_size = jnp.shape(k_pages.values)[:2]
  if page_size % _PAGE_ALIGN or not _PAGE_ALIGN <= page_size <= _MAX_PAGE_SIZE:
    raise ValueError(f"page_size must be a multiple of {_PAGE_ALIGN} from {_PAGE_ALIGN} to "
                     f"{_MAX_PAGE_SIZE}, got {page_size}")
  batch, max_new = jnp.shape(q)[:2]
  _check_table(page_table, cache_lengths, query_lengths, batch, max_new, num_pages, page_size)
  sinks = validation.check_sinks(sinks, jnp.shape(q)[2])
  if query_lengths is None:
    query_lengths = jnp.full((batch,), max_new, jnp.int32)
  query_lengths = jnp.asarray(query_lengths, jnp.int32)

  def per_shard(q, k_codes, v_codes, k_scales, v_scales, table, q_lens, kv_lens):
    return paged_attention(
        jnp.asarray(q, jnp.float32),
        paged_fp8.gather_dequantized(paged_fp8.Fp8Pages(k_codes, k_scales), table),
        paged_fp8.gather_dequantized(paged_fp8.Fp8Pages(v_codes, v_scales), table),
        paged_fp8.own_pages_table(table), kv_lens, query_lengths=q_lens,
        implementation=implementation, return_lse=True, **kwargs)

  partitioned = sharding.paged_partitioned(per_shard, 1, fp8_scales=True)

  def attend(q, k_codes, v_codes, k_scales, v_scales, table, kv_lens, q_lens):
    return partitioned(q, k_codes, v_codes, k_scales, v_scales, table, q_lens, kv_lens)

  out, lse = sharding.on_explicit_mesh(
      attend, q, (k_pages.values, v_pages.values, k_pages.scales, v_pages.scales),
      jnp.asarray(page_table, jnp.int32), jnp.asarray(cache_lengths, jnp.int32),
      query_lengths, fp8_scales=True)
  return _with_sinks(out.astype(dtype), lse, query_lengths, sinks, return_lse)


def paged_attention_reference(q, k_pages, v_pages, page_table, cache_lengths, query_lengths, *,
                              scale, softcap=0.0, window_left=-1, window_right=0):
  """The same maths in XLA over the gathered pages, in float32: returns
  ``(out in q's dtype, lse)``.

  NaN semantics of ``reference.attention_reference``: a NaN or Inf in a
  position a query row sees (its q row, a visible key's k or v) makes that
  row's output (for v: that column) non-finite and, for q or k, its lse NaN,
  as a float32 softmax would; nothing the row does not see reaches it (slots
  past the lengths, other rows' keys, unused pages). A row that sees no key
  gives zeros and lse ``-inf``."""
  batch, max_new, heads_q, _ = q.shape
  num_pages, page_size, heads_kv = k_pages.shape[:3]
  max_keys = page_table.shape[1] * page_size
  ids = jnp.asarray(page_table, jnp.int32)
  ids = jnp.where((ids >= 0) & (ids < num_pages), ids, num_pages)  # outside the pool: zeros

  def gather(pages):
    if num_pages == 0:  # every id is outside the pool (jnp.take refuses an empty axis)
      return jnp.zeros((batch, max_keys, *pages.shape[2:]), jnp.float32)
    return jnp.take(pages, ids, axis=0, mode="fill", fill_value=0).reshape(
        batch, max_keys, *pages.shape[2:]).astype(jnp.float32)

  keys, values = gather(k_pages), gather(v_pages)
  lengths = jnp.clip(cache_lengths, 0, max_keys)
  q_lens = jnp.clip(query_lengths, 0, max_new)
  position = (lengths - q_lens)[:, None] + jnp.arange(max_new)[None]  # [B, T]
  key = jnp.arange(max_keys)
  visible = (key[None, None] < lengths[:, None, None]) & (
      jnp.arange(max_new)[None, :, None] < q_lens[:, None, None])
  if window_left >= 0:
    visible &= key[None, None] >= position[..., None] - window_left
  if window_right >= 0:
    visible &= key[None, None] <= position[..., None] + window_right
  # Float32 products, also where XLA would take TF32.
  with jax.default_matmul_precision("highest"):
    logits, _ = reference._logits(q.astype(jnp.float32), keys, scale=scale, softcap=softcap,
                                  acc_dtype=jnp.float32)  # [B, K, G, T, S], NaN if not finite
    logits = jnp.where(visible[:, None, None], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)  # NaN if a visible logit is
    weights = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    total = jnp.sum(weights, axis=-1, keepdims=True)
    seen = total != 0  # NaN included
    safe_total = jnp.where(seen, total, 1.0)
    out = jnp.einsum("bkgts,bskh->btkgh", weights / safe_total, reference._finite_or_zero(values))
    bad_values = reference._nonfinite_seen(visible, values, "ts")  # [B, T, K, Hv]
  out = jnp.where(bad_values[:, :, :, None], jnp.nan, out).reshape(batch, max_new, heads_q, -1)
  lse = jnp.where(seen, row_max + jnp.log(safe_total), -jnp.inf)[..., 0]
  return out.astype(q.dtype), lse.reshape(batch, heads_q, max_new)


def merge_splits(out, lse):
  """Merges per-split results ``out [batch, splits, T, H, D]`` / ``lse
  [batch, splits, H, T]`` into ``([batch, T, H, D] in out's dtype, lse)``.

  The sums run as a halving tree over the splits padded to a power of two,
  which is the same tree for every split count: splits without visible keys
  (lse ``-inf``, zero output) add exact zeros, so a row's result depends
  only on its own splits, not on how many the batch needed."""
  splits = out.shape[1]
  if splits == 1:
    return out[:, 0], lse[:, 0]
  top = jnp.max(lse, axis=1)  # exact, in any order
  finite_top = jnp.where(jnp.isfinite(top), top, 0.0)
  weights = jnp.exp(lse - finite_top[:, None])  # [B, n, H, T]
  weighted = out.astype(jnp.float32) * jnp.swapaxes(weights, -1, -2)[..., None]
  total = _halving_sum(weights)
  merged = _halving_sum(weighted) / jnp.swapaxes(jnp.where(total > 0, total, 1.0), -1, -2)[..., None]
  merged_lse = jnp.where(total > 0, finite_top + jnp.log(total), -jnp.inf)
  return merged.astype(out.dtype), merged_lse


def _halving_sum(x):
  """Sum over axis 1 as x[:half] + x[half:] with x zero-padded to a power of
  two along it (see merge_splits)."""
  n = x.shape[1]
  width = 1 << (n - 1).bit_length()
  x = jnp.pad(x, [(0, 0), (0, width - n)] + [(0, 0)] * (x.ndim - 2))
  while width > 1:
    width //= 2
    x = x[:, :width] + x[:, width:]
  return x[:, 0]


def _paged_fp8_kernel(q, k_codes, v_codes, k_scales, v_scales, page_table, cache_lengths,
                      query_lengths, **kwargs):
  """Hopper's FP8-cache kernel (_paged_kernel's on the pools' four arrays)."""
  return _paged_kernel(q, k_codes, v_codes, page_table, cache_lengths, query_lengths,
                       scales=(k_scales, v_scales), **kwargs)


def _paged_kernel(q, k_pages, v_pages, page_table, cache_lengths, query_lengths, *, scale,
                  softcap, window_left, window_right, split_keys, partitioned=True, scales=()):
  """The GPU kernel (Hopper's or the sm80 family's: the CUDA handler picks;
  Hopper's FP8-cache kernel where ``scales``, the FP8 cache's (k, v), are
  given with its codes as the pools); ``partitioned=False`` where the caller
  is itself partitioned per shard (kv_split.py, inside attention's kernel
  call)."""
  target = paged_fp8.KERNEL_TARGET if scales else _PAGED_TARGET
  batch, max_new, heads_q, _ = q.shape
  page_size, heads_kv = k_pages.shape[1], k_pages.shape[2]
  split_pages = split_keys // page_size
  splits = -(-page_table.shape[1] // split_pages)
  table = jnp.pad(page_table, [(0, 0), (0, splits * split_pages - page_table.shape[1])])
  group = heads_q // heads_kv
  # One new token per sequence sees every key of its cache (unless a left
  # window moves with it): its GQA group's heads share a tile as rows.
  packed = max_new == 1 and group > 1 and window_left < 0
  rows, q_lens = q, query_lengths
  if packed:
    rows = q.reshape(batch, heads_kv, group, q.shape[-1]).transpose(0, 2, 1, 3)
    q_lens = query_lengths * group
    window_right = -1
  kernel = functools.partial(_ffi_call, target, split_pages=split_pages, scale=scale,
                             softcap=softcap, window_left=window_left, window_right=window_right)
  if partitioned:
    kernel = sharding.paged_partitioned(kernel, splits, fp8_scales=bool(scales))
  out, lse = kernel(rows, k_pages, v_pages, *scales, table, q_lens, cache_lengths)
  out, lse = merge_splits(out.reshape(batch, splits, *out.shape[1:]),
                          lse.reshape(batch, splits, *lse.shape[1:]))
  if packed:
    out = out.transpose(0, 2, 1, 3).reshape(batch, 1, heads_q, out.shape[-1])
    lse = lse.reshape(batch, heads_q, 1)  # [B, Hkv, group]: head kv * group + g
  # Padding rows come out of the kernel as whatever their queries made of
  # them (NaN for NaN): zero, as documented.
  padding = jnp.arange(max_new)[None, :, None, None] >= query_lengths[:, None, None, None]
  return jnp.where(padding, jnp.zeros((), out.dtype), out), lse


def _ffi_call(target, rows, k_pages, v_pages, *operands, split_pages, scale, softcap,
              window_left, window_right):
  """One paged kernel call on (the local shards of) its operands: out
  ``[batch * splits, T, H, Dv]`` and lse ``[batch * splits, H, T]``;
  ``operands``: (table, q_lens, kv_lens), after an FP8 cache's (k, v)
  scales."""
  *scales, table, q_lens, kv_lens = operands
  batch, seq_rows, heads, _ = rows.shape
  splits = table.shape[1] // split_pages
  out_types = (
      jax.ShapeDtypeStruct((batch * splits, seq_rows, heads, v_pages.shape[-1]), rows.dtype),
      jax.ShapeDtypeStruct((batch * splits, heads, seq_rows), jnp.float32),
  )
  return jax.ffi.ffi_call(target, out_types)(
      rows, k_pages, v_pages, *scales, table, q_lens, kv_lens, scale=np.float32(scale),
      softcap=np.float32(softcap), window_left=np.int32(window_left),
      window_right=np.int32(window_right), split_pages=np.int32(split_pages))


# A paged call traced where no GPU runs lowers for CUDA to the XLA composition
# (or fails with implementation="flash"): which GPU kernel can serve is known
# only where the call is traced on that GPU.
_GPU_FROM_ELSEWHERE = ("a paged call traced without a GPU has no GPU kernel; trace it "
                       "on the GPU that runs it, or use implementation=None")


def _per_platform(*args, implementation, reasons, split_keys, **mask):
  """The kernel of the platform the call is lowered for (see per_platform)."""
  return per_platform(
      args, kernels={"cpu": functools.partial(_paged_kernel_cpu, **mask),
                     "cuda": functools.partial(_paged_kernel, split_keys=split_keys, **mask)},
      reference=functools.partial(paged_attention_reference, **mask),
      output_types=_output_types, implementation=implementation, reasons=reasons,
      what="paged kernels")


def per_platform(args, *, kernels, reference, output_types, implementation, reasons, what):
  """``kernels[platform](*args)`` for the platform the call is lowered for
  (``jax.export`` may lower one trace for several): ``reasons`` maps "cpu"
  and "cuda" to why their kernel cannot serve it, or None. Without a kernel
  ``reference(*args)`` runs (``implementation=None``) or lowering fails
  ("flash"), saying why; ``output_types(*args)``: the results' types;
  ``what``: the kernels' name in that message for other platforms."""

  def branch(kernel, reason):
    def run(*a):
      if reason is None:
        return ffi.match_varying(tuple(kernel(*a)), a)
      if implementation is None:
        return ffi.match_varying(tuple(reference(*a)), a)
      zeros = (jnp.zeros(t.shape, t.dtype) for t in output_types(*a))
      return ffi.match_varying(tuple(ffi._unsupported_p.bind(
          *zeros, reason=f"implementation={implementation!r}: {reason}")), a)
    return run

  return jax.lax.platform_dependent(
      *args, cpu=branch(kernels["cpu"], reasons["cpu"]),
      cuda=branch(kernels["cuda"], reasons["cuda"]),
      default=branch(None, f"jax_flash has {what} for CPU and CUDA only"))


def _output_types(q, k_pages, v_pages, *_):
  batch, max_new, heads_q, _ = q.shape
  return (jax.ShapeDtypeStruct((batch, max_new, heads_q, v_pages.shape[-1]), q.dtype),
          jax.ShapeDtypeStruct((batch, heads_q, max_new), jnp.float32))


def _paged_kernel_cpu(q, k_pages, v_pages, page_table, cache_lengths, query_lengths, *, scale,
                      softcap, window_left, window_right):
  """The CPU kernel (cuda_src/cpu/paged_cpu.cc): each sequence whole, one
  task per (sequence, kv head, block of query rows), so no splits to merge."""
  max_pages = page_table.shape[1]
  out_type, lse_type = _output_types(q, k_pages, v_pages)
  if max_pages == 0:  # no cache: every row sees nothing
    return jnp.zeros(out_type.shape, q.dtype), jnp.full(lse_type.shape, -jnp.inf, jnp.float32)
  kernel = functools.partial(_ffi_call, _CPU_PAGED_TARGET, split_pages=max_pages, scale=scale,
                             softcap=softcap, window_left=window_left, window_right=window_right)
  return sharding.paged_partitioned(kernel, 1)(q, k_pages, v_pages, page_table, query_lengths,
                                               cache_lengths)


def _kernel_unavailable_reason(platform, q, shapes) -> str | None:
  if platform == "cpu":
    return configs.CPU.unsupported_reason(q.dtype, shapes["head_dim"], shapes["head_dim_v"])
  if platform != "gpu":
    return f"jax_flash has no paged kernel for platform {platform!r} yet"
  if not _CUDA_REGISTERED:
    return "this installation holds no paged GPU kernel"
  head_dim, head_dim_v = shapes["head_dim"], shapes["head_dim_v"]
  # The GPUs, dtypes and head dims of the sm80 family, which serves every
  # call the Hopper kernel does not (the CUDA handler picks), and the shared
  # memory its tiles take (8.6 / 8.9 lack it for head dim 256).
  reason = (_gpu_support.gpu_unavailable_reason()
            or configs.GPU.unsupported_reason(q.dtype, head_dim, head_dim_v))
  if reason is None and head_dim_v != head_dim:
    reason = (f"the paged GPU kernels need head_dim_v == head_dim, got head_dim={head_dim}, "
              f"head_dim_v={head_dim_v}")
  return reason or _gpu_support.device_reason("forward", head_dim)


def _check_paged(q, k_pages, v_pages, page_table, cache_lengths, query_lengths,
                 kv_split_size, fp8_cache=False) -> dict:
  if jnp.ndim(q) != 4:
    raise ValueError("q must have rank 4 [batch, max_new_tokens, heads_q, head_dim], got shape "
                     f"{jnp.shape(q)}")
  for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
    if jnp.ndim(pages) != 4:
      raise ValueError(f"{name} must have rank 4 [num_pages, page_size, heads_kv, dim], got "
                       f"shape {jnp.shape(pages)}")
  batch, max_new, heads_q, head_dim = jnp.shape(q)
  num_pages, page_size, heads_kv, key_dim = jnp.shape(k_pages)
  if jnp.shape(v_pages)[:3] != (num_pages, page_size, heads_kv):
    raise ValueError(f"v_pages must have k_pages' leading shape {(num_pages, page_size, heads_kv)}, "
                     f"got {jnp.shape(v_pages)[:3]}")
  if key_dim != head_dim:
    raise ValueError(f"k_pages must have q's head_dim {head_dim}, got {key_dim}")
  if head_dim == 0 or heads_kv == 0 or heads_q % heads_kv:
    raise ValueError(f"heads_q must be a positive multiple of heads_kv and head_dim positive, got "
                     f"heads_q={heads_q}, heads_kv={heads_kv}, head_dim={head_dim}")
  dtypes = {jnp.result_type(x) for x in ((q,) if fp8_cache else (q, k_pages, v_pages))}
  if len(dtypes) != 1:
    raise ValueError(f"q, k_pages and v_pages must share one dtype, got {sorted(map(str, dtypes))}")
  if page_size % _PAGE_ALIGN or not _PAGE_ALIGN <= page_size <= _MAX_PAGE_SIZE:
    raise ValueError(f"page_size must be a multiple of {_PAGE_ALIGN} from {_PAGE_ALIGN} to "
                     f"{_MAX_PAGE_SIZE}, got {page_size}")
  if kv_split_size is None:
    kv_split_size = DEFAULT_KV_SPLIT_SIZE // page_size * page_size
  if not validation.is_positive_multiple(kv_split_size, page_size):
    raise ValueError(f"kv_split_size must be a positive multiple of page_size {page_size}, got "
                     f"{kv_split_size!r}")
  _check_table(page_table, cache_lengths, query_lengths, batch, max_new, num_pages, page_size)
  return {"head_dim": head_dim, "head_dim_v": jnp.shape(v_pages)[3],
          "split_keys": int(kv_split_size)}


def _check_table(page_table, cache_lengths, query_lengths, batch, max_new, num_pages, page_size):
  """Shapes always; values where they are concrete (outside jit)."""
  if jnp.ndim(page_table) != 2 or jnp.shape(page_table)[0] != batch:
    raise ValueError(f"page_table must be [batch={batch}, max_pages], got shape "
                     f"{jnp.shape(page_table)}")
  for name, lengths in (("cache_lengths", cache_lengths), ("query_lengths", query_lengths)):
    if lengths is None:
      continue
    if jnp.shape(lengths) != (batch,):
      raise ValueError(f"{name} must have shape ({batch},), got {jnp.shape(lengths)}")
    if not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
      raise ValueError(f"{name} must be integers, got {jnp.result_type(lengths)}")
  for name, x in (("page_table", page_table), ("cache_lengths", cache_lengths)):
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
      raise ValueError(f"{name} must be integers, got {jnp.result_type(x)}")
  traced = [x for x in (page_table, cache_lengths, query_lengths)
            if isinstance(x, jax.core.Tracer)]
  if traced:
    return
  table = np.asarray(page_table)
  lengths = np.asarray(cache_lengths)
  new = np.full(batch, max_new) if query_lengths is None else np.asarray(query_lengths)
  capacity = table.shape[1] * page_size
  for b in np.flatnonzero((new < 0) | (new > max_new))[:1]:
    raise ValueError(f"query_lengths[{b}] must be in [0, {max_new}], got {new[b]}")
  for b in np.flatnonzero((lengths < new) | (lengths > capacity))[:1]:
    raise ValueError(f"cache_lengths[{b}] must be in [query_lengths[{b}]={new[b]}, "
                     f"max_pages * page_size={capacity}], got {lengths[b]}")
  used = np.arange(table.shape[1])[None] < -(-lengths[:, None] // page_size)
  bad = used & ((table < 0) | (table >= num_pages))
  for b, slot in np.argwhere(bad)[:1]:
    raise ValueError(f"page_table[{b}, {slot}] = {table[b, slot]} holds tokens of the first "
                     f"cache_lengths[{b}]={lengths[b]}; page ids must be in [0, "
                     f"num_pages={num_pages})")
