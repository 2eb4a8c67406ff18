"""Multi-head latent attention (MLA, DeepSeek-V2/V3) decoding against a
paged latent cache, in bfloat16 / float16 or FP8 (docs/mla.md).

MLA caches one 576-wide row per token, shared by every query head: 512
latent columns and 64 RoPE columns. With the up-projections absorbed into
the queries, decoding is multi-query attention with head dim 576 for
``Q K^T`` and the row's first 512 columns as V. The cache is paged as in
``jax_flash.paged_attention`` (its page table, lengths and causal rule),
in pages of 64 tokens.

On Hopper GPUs both cache formats run jax_flash's kernels
(``cuda_src/mla_sm90``: kernel.py for bfloat16 / float16, kernel_fp8.py for
FP8, its queries quantised here first, as ``mla_fp8.fp8_reference`` does):
the keys of each sequence cut into splits of a fixed number of keys, one
CTA per 64 packed query rows (s_q x heads) and split, the splits merged by
``paged.merge_splits``. Every other call (CPUs, other GPUs) runs the XLA
composition (``mla_reference``).
"""


import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import AxisType

from jax_flash import _api as api, _ffi as ffi, _paged as paged, _sharding as sharding
from jax_flash import _validation as validation
from jax_flash._sinks import add_sinks
from jax_flash._mla_fp8 import (FP8_DTYPE, HEAD_DIM, LATENT_DIM, PAGE_SIZE, ROPE_DIM,
                               ROPE_DTYPE, MlaFp8Cache, empty_fp8_cache, fp8_reference,
                               quantize_latent, write_fp8_cache,
                               write_token_rows)

__all__ = ["MlaFp8Cache", "empty_mla_cache", "mla_decode", "mla_reference", "quantize_latent",
           "write_mla_cache"]

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MLA_TARGET = "jax_flash_gpu_mla_decode_v1"
_MLA_FP8_TARGET = "jax_flash_gpu_mla_decode_fp8_v1"
# The kernel's query rows per CTA (cuda_src/mla_sm90/kernel.py: ROWS).
_ROW_TILE = 64
# Keys per split of the Hopper kernel, by whether a sequence's query rows
# (s_q x heads) fill one tile of 64 or more: with one tile (the memory-bound
# tensor-parallel shards) shorter splits give a batch of 32 enough CTAs; with
# more, longer ones halve the partial results to merge. Neither depends on
# the batch, so results stay batch invariant.
_SPLIT_KEYS_ONE_TILE = 1024
_SPLIT_KEYS = 2048


def _register_cuda(handler_name: str, target: str, has_kernel) -> bool:
  """Registers the handler when the library holds it and its kernel."""
  library = ffi._cuda_library
  handler = getattr(library, handler_name, None) if library is not None else None
  if handler is None or not has_kernel(library):
    return False
  jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="CUDA")
  return True


_CUDA_REGISTERED = _register_cuda(
    "JaxFlashMlaDecodeCuda", _MLA_TARGET,
    lambda library: getattr(library, "jax_flash_mla_sm90", None) is not None)
# The FP8 kernel is in the library when export.py exported it (not under --only).
_CUDA_FP8_REGISTERED = _register_cuda(
    "JaxFlashMlaDecodeFp8Cuda", _MLA_FP8_TARGET,
    lambda library: getattr(library, "jax_flash_mla_sm90_fp8_available", None) is not None
    and library.jax_flash_mla_sm90_fp8_available() == 1)


def mla_decode(q, cache, page_table, cache_lengths, *, scale, query_lengths=None, sinks=None,
               return_lse: bool = False, implementation: str | None = None):
  """MLA attention of new tokens against a paged latent cache (forward only).

  Each sequence ``b`` has ``cache_lengths[b]`` tokens in its cache, the last
  ``query_lengths[b]`` of which are its new tokens, already written
  (``write_mla_cache``): query row ``t`` is token ``cache_lengths[b] -
  query_lengths[b] + t`` and sees the cache up to itself, so speculative
  tokens are causal among themselves (``paged_attention``'s rule).

  Args:
    q: ``[batch, s_q, heads, 576]`` bfloat16 or float16: per head, the
      absorbed query (512 latent columns, ``q_nope @ W_UK``) then its 64
      RoPE columns. Rows past a sequence's ``query_lengths`` are padding
      (zero output, lse ``-inf``).
    cache: ``[num_pages, 64, 576]`` in q's dtype (the latent then the
      RoPE columns of each token), or an ``MlaFp8Cache`` (q bfloat16), whose
      queries are quantised per token and head like its tokens (docs/mla.md).
    page_table: int32 ``[batch, max_pages]``: token ``i`` of sequence ``b``
      sits in page ``page_table[b, i // 64]`` at row ``i % 64``. Entries
      past a sequence's last page are never read.
    cache_lengths: int32 ``[batch]``, new tokens included. Slots past it
      may hold anything, NaN included.
    scale: the softmax scale, required: MLA's comes from the head dim of
      the un-absorbed attention, not from the cache's 576 columns.
      DeepSeek-V2/V3 use ``(128 + 64) ** -0.5``, times ``mscale ** 2`` with
      YaRN context extension (V3: ``mscale = 0.1 * ln(40) + 1``).
    query_lengths: int32 ``[batch]``, new tokens per sequence; ``None``:
      ``s_q`` for every sequence.
    sinks: attention sinks, float32 ``[heads]``, as in ``attention``
      (added to the merged result, in both cache formats); rows that see
      no key, padding rows included, then output zeros with an lse equal
      to their sink.
    return_lse: also return the natural-log log-sum-exp, float32
      ``[batch, heads, s_q]``.
    implementation: ``None`` runs jax_flash's kernel where one applies and
      the XLA composition elsewhere; ``"flash"`` raises
      ``NotImplementedError`` where no kernel applies; ``"xla"``: the XLA
      composition (``mla_reference``). The kernels: both cache formats on a
      Hopper GPU.

  Page ids and lengths are checked when they are concrete; inside ``jit`` a
  page id outside the pool reads zeros and lengths clip to the table. A NaN
  or Inf in a position a row sees (its query, a visible token) reaches that
  row; nothing it does not see does. Heads shard over a mesh axis with the
  cache replicated (tensor parallel): each device computes its heads with no
  communication. No gradient is defined.

  Returns:
    ``out [batch, s_q, heads, 512]`` in q's dtype, or ``(out, lse)``.
  """
  validation.check_implementation(implementation, (None, "flash", "xla"))
  _check_mla(q, cache, page_table, cache_lengths, query_lengths)
  scale = _check_scale(scale)
  return_lse = validation.check_flag(return_lse, "return_lse")
  sinks = validation.check_sinks(sinks, jnp.shape(q)[2])
  reason = None if implementation == "xla" else _kernel_unavailable_reason(q, cache)
  if implementation == "flash" and reason is not None:
    raise NotImplementedError(f"implementation='flash': {reason}")
  batch, max_new = jnp.shape(q)[:2]
  if query_lengths is None:
    query_lengths = jnp.full((batch,), max_new, jnp.int32)
  attend = mla_reference if implementation == "xla" or reason is not None else _mla_kernel
  out, lse = attend(q, cache, jnp.asarray(page_table, jnp.int32),
                    jnp.asarray(cache_lengths, jnp.int32),
                    jnp.asarray(query_lengths, jnp.int32), scale=scale)
  if sinks is not None:
    # A padding row sees no key, whatever its query left in the lse.
    padding = jnp.arange(max_new)[None, None, :] >= jnp.asarray(query_lengths)[:, None, None]
    out, lse = add_sinks(out, jnp.where(padding, -jnp.inf, lse), sinks)
  return (out, lse) if return_lse else out


def _mla_kernel(q, cache, page_table, cache_lengths, query_lengths, *, scale: float):
  """The Hopper kernels: per (64 packed query rows, sequence, split) a
  partial result, merged in ``paged.merge_splits``'s fixed order. The FP8
  cache's queries are quantised per token and head here, by
  ``quantize_latent``, so that their codes are the reference's bit for bit."""
  batch, s_q, heads, _ = q.shape
  split_keys = _SPLIT_KEYS_ONE_TILE if s_q * heads <= _ROW_TILE else _SPLIT_KEYS
  split_pages = split_keys // PAGE_SIZE
  max_pages = page_table.shape[1]
  splits = max(-(-max_pages // split_pages), 1)
  # Lengths clip to the table (as in the composition); its padding is never read.
  cache_lengths = jnp.clip(cache_lengths, 0, max_pages * PAGE_SIZE)
  table = jnp.pad(page_table, [(0, 0), (0, splits * split_pages - max_pages)])
  out_types = (jax.ShapeDtypeStruct((batch * splits, s_q, heads, LATENT_DIM), q.dtype),
               jax.ShapeDtypeStruct((batch * splits, s_q, heads), jnp.float32))
  attributes = dict(scale=np.float32(scale), split_pages=np.int32(split_pages))
  if isinstance(cache, MlaFp8Cache):
    q_codes, q_scales, q_rope = quantize_latent(q)
    out, lse = jax.ffi.ffi_call(_MLA_FP8_TARGET, out_types)(
        q_codes, q_scales, q_rope, cache.latent, cache.scales, cache.rope, table, query_lengths,
        cache_lengths, **attributes)
  else:
    out, lse = jax.ffi.ffi_call(_MLA_TARGET, out_types)(
        q, cache, table, query_lengths, cache_lengths, **attributes)
  out, lse = paged.merge_splits(out.reshape(batch, splits, s_q, heads, LATENT_DIM),
                                jnp.swapaxes(lse.reshape(batch, splits, s_q, heads), -1, -2))
  return out, lse


def mla_reference(q, cache, page_table, cache_lengths, query_lengths, *, scale: float):
  """The XLA composition over gathered pages: ``(out in q's dtype, lse)``.

  The bfloat16 / float16 cache: exact softmax attention in float32
  (``paged.paged_attention_reference`` on the cache as one kv head, V its
  first 512 columns). The FP8 cache: the kernel's maths
  (``mla_fp8.fp8_reference``: FP8 query and latent products, P requantised
  per row and key block)."""
  if isinstance(cache, MlaFp8Cache):
    return fp8_reference(q, cache, page_table, cache_lengths, query_lengths, scale=scale)
  pool = cache[:, :, None]  # [num_pages, 64, 1 kv head, 576]
  return paged.paged_attention_reference(q, pool, pool[..., :LATENT_DIM], page_table,
                                         cache_lengths, query_lengths, scale=scale)


def write_mla_cache(cache, latent, page_table, cache_lengths, query_lengths=None):
  """Writes the new tokens' latent rows ``[batch, max_new, 576]`` into their
  pages: row ``t`` of sequence ``b`` becomes token ``cache_lengths[b] -
  query_lengths[b] + t`` (``mla_decode``'s arguments). Rows past
  ``query_lengths[b]`` and tokens whose page id lies outside the pool are
  dropped. An ``MlaFp8Cache`` takes rows of any float dtype and quantises
  them per token (``quantize_latent``); a bfloat16 / float16 cache takes
  its own dtype. Returns the new cache: under ``jit`` with the cache donated
  (``donate_argnums``) XLA writes it in place."""
  fp8 = isinstance(cache, MlaFp8Cache)
  num_pages = _check_cache(cache, None if fp8 else jnp.result_type(cache))
  if jnp.ndim(latent) != 3 or jnp.shape(latent)[-1] != HEAD_DIM:
    raise ValueError(f"latent must be [batch, max_new_tokens, {HEAD_DIM}] ({LATENT_DIM} latent "
                     f"+ {ROPE_DIM} RoPE columns), got shape {jnp.shape(latent)}")
  batch, max_new = jnp.shape(latent)[:2]
  paged._check_table(page_table, cache_lengths, query_lengths, batch, max_new, num_pages,
                     PAGE_SIZE)
  if fp8:
    if not jnp.issubdtype(jnp.result_type(latent), jnp.floating):
      raise ValueError(f"latent must be floating point, got {jnp.result_type(latent)}")
    return write_fp8_cache(cache, latent, page_table, cache_lengths, query_lengths)
  if jnp.result_type(latent) != jnp.result_type(cache):
    raise ValueError(f"latent must have the cache's dtype {jnp.result_type(cache)}, got "
                     f"{jnp.result_type(latent)}")
  (written,) = write_token_rows((cache,), (latent,), page_table, cache_lengths, query_lengths)
  return written


def empty_mla_cache(num_pages: int, kv_dtype=jnp.bfloat16):
  """A zero cache of ``num_pages`` pages: a ``[num_pages, 64, 576]`` array
  for bfloat16 / float16, an ``MlaFp8Cache`` for ``float8_e4m3fn``."""
  if isinstance(num_pages, (bool, np.bool_)) or not isinstance(num_pages, (int, np.integer)) \
      or num_pages < 0:
    raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
  dtype = jnp.dtype(kv_dtype)
  if dtype == FP8_DTYPE:
    return empty_fp8_cache(int(num_pages))
  if dtype not in _DTYPES:
    raise ValueError(f"kv_dtype must be bfloat16, float16 or float8_e4m3fn, got {dtype.name}")
  return jnp.zeros((int(num_pages), PAGE_SIZE, HEAD_DIM), dtype)


def _kernel_unavailable_reason(q, cache) -> str | None:
  """Why the Hopper kernel cannot serve this call, or None."""
  if _sharded_over_explicit_axes(q):
    return ("the MLA decode kernel has no partitioning rule yet, and q is sharded over "
            "Explicit mesh axes; implementation=None or 'xla' runs the XLA composition, which "
            "partitions by itself")
  platform = api._platform_of(q, cache)
  if platform != "gpu":
    return (f"jax_flash's MLA decode kernel runs on Hopper GPUs, not on platform {platform!r}; "
            "implementation=None or 'xla' runs the XLA composition")
  fp8 = isinstance(cache, MlaFp8Cache)
  if not (_CUDA_FP8_REGISTERED if fp8 else _CUDA_REGISTERED):
    return (f"this installation holds no MLA decode kernel for GPUs for the "
            f"{'FP8' if fp8 else 'bfloat16 / float16'} cache")
  capability = ffi.gpu_compute_capability()
  if capability is None or capability[0] != 9:
    return f"the MLA decode kernel needs a Hopper GPU (compute capability 9.x), got {capability}"
  if jnp.shape(cache.latent if fp8 else cache)[0] == 0:
    return "the MLA decode kernel needs a cache of at least one page"
  return None


def _sharded_over_explicit_axes(q) -> bool:
  """Whether q's type shards it over an Explicit mesh axis (an ffi_call
  there needs a rule for its results' shardings)."""
  q_sharding = jax.typeof(q).sharding
  explicit = {name for name, kind in zip(q_sharding.mesh.axis_names, q_sharding.mesh.axis_types)
              if kind == AxisType.Explicit}
  return any(set(sharding.axes_of(entry)) & explicit
             for entry in sharding._spec(q_sharding, jnp.ndim(q)))


def _check_scale(scale) -> float:
  if scale is None:
    raise ValueError("scale must be given: MLA's softmax scale comes from the un-absorbed head "
                     "dim, not from the cache's 576 columns (DeepSeek-V2/V3: (128 + 64) ** -0.5, "
                     "times mscale ** 2 with YaRN)")
  return validation.check_scale(scale, HEAD_DIM)


def _check_mla(q, cache, page_table, cache_lengths, query_lengths) -> None:
  if jnp.ndim(q) != 4 or jnp.shape(q)[-1] != HEAD_DIM:
    raise ValueError(f"q must be [batch, s_q, heads, {HEAD_DIM}] ({LATENT_DIM} latent + "
                     f"{ROPE_DIM} RoPE columns), got shape {jnp.shape(q)}")
  batch, s_q, heads, _ = jnp.shape(q)
  if s_q < 1 or heads < 1:
    raise ValueError(f"q must have s_q >= 1 and heads >= 1, got shape {jnp.shape(q)}")
  dtype = jnp.result_type(q)
  if dtype not in _DTYPES:
    raise ValueError(f"q must be bfloat16 or float16, got {dtype}")
  if isinstance(cache, MlaFp8Cache) and dtype != ROPE_DTYPE:
    raise ValueError(f"q must be bfloat16 with an FP8 cache (its RoPE columns multiply the "
                     f"cache's bfloat16 RoPE columns), got {dtype}")
  num_pages = _check_cache(cache, dtype)
  paged._check_table(page_table, cache_lengths, query_lengths, batch, s_q, num_pages, PAGE_SIZE)


def _check_cache(cache, dtype) -> int:
  """The cache's number of pages, after checking its format; ``dtype``: the
  bfloat16 / float16 cache's expected dtype (None: its own)."""
  if isinstance(cache, MlaFp8Cache):
    return _check_fp8_cache(cache)
  if not hasattr(cache, "shape") or not hasattr(cache, "dtype"):
    raise ValueError(f"cache must be a [num_pages, {PAGE_SIZE}, {HEAD_DIM}] array or an "
                     f"MlaFp8Cache, got {type(cache).__name__}")
  if jnp.ndim(cache) != 3:
    raise ValueError(f"cache must have rank 3 [num_pages, {PAGE_SIZE}, {HEAD_DIM}], got shape "
                     f"{jnp.shape(cache)}")
  num_pages, page_size, width = jnp.shape(cache)
  _check_page_size(page_size, "cache")
  if width != HEAD_DIM:
    raise ValueError(f"cache rows must be {HEAD_DIM} wide ({LATENT_DIM} latent + {ROPE_DIM} "
                     f"RoPE), got {width}")
  cache_dtype = jnp.result_type(cache)
  if cache_dtype not in _DTYPES or (dtype is not None and cache_dtype != dtype):
    want = "bfloat16 or float16" if dtype is None else f"q's dtype {jnp.dtype(dtype).name}"
    raise ValueError(f"cache must be {want} (or an MlaFp8Cache), got {cache_dtype}")
  return num_pages


def _check_fp8_cache(cache: MlaFp8Cache) -> int:
  num_pages = jnp.shape(cache.latent)[0] if jnp.ndim(cache.latent) else 0
  parts = (("latent", cache.latent, (num_pages, PAGE_SIZE, LATENT_DIM), FP8_DTYPE),
           ("scales", cache.scales, (num_pages, PAGE_SIZE), jnp.dtype(jnp.float32)),
           ("rope", cache.rope, (num_pages, PAGE_SIZE, ROPE_DIM), ROPE_DTYPE))
  for name, part, shape, dtype in parts:
    if jnp.ndim(part) == len(shape) and len(shape) > 1:
      _check_page_size(jnp.shape(part)[1], f"cache.{name}")
    if jnp.shape(part) != shape:
      raise ValueError(f"cache.{name} must have shape {shape} [num_pages, page_size"
                       f"{', width' if len(shape) == 3 else ''}], got {jnp.shape(part)}")
    if jnp.result_type(part) != dtype:
      raise ValueError(f"cache.{name} must be {dtype.name}, got {jnp.result_type(part)}")
  return num_pages


def _check_page_size(page_size: int, name: str) -> None:
  if page_size != PAGE_SIZE:
    raise ValueError(f"{name} must hold pages of {PAGE_SIZE} tokens (the kernels' key tile), "
                     f"got {page_size}")
