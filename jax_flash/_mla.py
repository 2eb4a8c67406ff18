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
``paged.merge_splits``. On CPUs both formats run ``cuda_src/cpu/mla_cpu.cc``,
each sequence whole. Every other call (other GPUs) runs the XLA composition
(``mla_reference``). The kernels shard over heads (the cache replicated) and
batch, with no communication (``sharding.paged_partitioned``).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _cpu_ffi
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
# The kernels' FFI targets by platform and cache format (FP8 or not).
_CUDA_TARGETS = {False: "jax_flash_gpu_mla_decode_v1", True: "jax_flash_gpu_mla_decode_fp8_v1"}
_CPU_TARGETS = {False: "jax_flash_cpu_mla_decode_v1", True: "jax_flash_cpu_mla_decode_fp8_v1"}
# The kernel's query rows per CTA (cuda_src/mla_sm90/kernel.py: ROWS).
_ROW_TILE = 64
# Keys per split of the Hopper kernel, by whether a sequence's query rows
# (s_q x heads) fill one tile of 64 or more: with one tile (the memory-bound
# tensor-parallel shards) shorter splits give a batch of 32 enough CTAs; with
# more, longer ones halve the partial results to merge. Neither depends on
# the batch, so results stay batch invariant.
_SPLIT_KEYS_ONE_TILE = 1024
_SPLIT_KEYS = 2048


# Whether the Hopper kernel of each cache format (FP8 or not) is registered;
# the FP8 one is in the library when export.py exported it (not under --only).
_CUDA_REGISTERED = {
    False: ffi.register_cuda_handler("JaxFlashMlaDecodeCuda", _CUDA_TARGETS[False],
                          lambda library: getattr(library, "jax_flash_mla_sm90", None) is not None),
    True: ffi.register_cuda_handler(
        "JaxFlashMlaFp8DecodeCuda", _CUDA_TARGETS[True],
        lambda library: getattr(library, "jax_flash_mla_sm90_fp8_available", None) is not None
        and library.jax_flash_mla_sm90_fp8_available() == 1)}
for _name, _capsule in _cpu_ffi.mla_registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")


def mla_decode(q, cache, page_table, cache_lengths, *, scale, query_lengths=None, sinks=None,
               kv_split_size: int | None = None, return_lse: bool = False,
               implementation: str | None = None):
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
    kv_split_size: keys per split of the Hopper kernels, a multiple of 64;
      ``None``: 1024 where a sequence's query rows (``s_q x heads``) fit one
      tile of 64 (the memory-bound tensor-parallel shards), else 2048.
      Results are batch invariant for one value of it, and change in their
      last bits with it: keep it fixed across a deployment. Longer splits
      suit large batches (fewer partial results to merge), shorter ones
      give small batches more parallelism (docs/mla.md). The CPU kernel
      and the composition do not split.
    return_lse: also return the natural-log log-sum-exp, float32
      ``[batch, heads, s_q]``.
    implementation: ``None`` runs jax_flash's kernel where one applies and
      the XLA composition elsewhere; ``"flash"`` raises
      ``NotImplementedError`` where no kernel applies; ``"xla"``: the XLA
      composition (``mla_reference``). The kernels: both cache formats on a
      Hopper GPU and on a CPU.

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
  kv_split_size = _check_kv_split_size(kv_split_size)
  batch, max_new = jnp.shape(q)[:2]
  if query_lengths is None:
    query_lengths = jnp.full((batch,), max_new, jnp.int32)
  operands = (jnp.asarray(page_table, jnp.int32), jnp.asarray(cache_lengths, jnp.int32),
              jnp.asarray(query_lengths, jnp.int32))
  if implementation == "xla":
    out, lse = mla_reference(q, cache, *operands, scale=scale)
  else:
    out, lse = _on_kernels(q, cache, *operands, scale=scale, kv_split_size=kv_split_size,
                           implementation=implementation)
  if sinks is not None:
    # A padding row sees no key, whatever its query left in the lse.
    padding = jnp.arange(max_new)[None, None, :] >= jnp.asarray(query_lengths)[:, None, None]
    out, lse = add_sinks(out, jnp.where(padding, -jnp.inf, lse), sinks)
  return (out, lse) if return_lse else out


def _on_kernels(q, cache, page_table, cache_lengths, query_lengths, *, scale, kv_split_size,
                implementation):
  """The kernel of the platform the call is lowered for (``paged.per_platform``),
  on each device's shard where q is sharded over Explicit mesh axes."""
  platform = api._platform_of(q, cache)
  reasons = {"cpu": _cpu_unavailable_reason(cache),
             "cuda": _kernel_unavailable_reason(q, cache) if platform == "gpu" else
             _GPU_FROM_ELSEWHERE}
  local = reasons.get({"gpu": "cuda"}.get(platform, platform),
                      f"jax_flash has no MLA decode kernel for platform {platform!r}")
  if local is not None and implementation == "flash":
    raise NotImplementedError(f"implementation='flash': {local}")
  pools, layout = jax.tree.flatten(cache)

  def with_cache(fn):  # fn(q, cache, ...) on the flat operands
    return lambda q, *rest: fn(q, layout.unflatten(rest[:len(pools)]), *rest[len(pools):],
                               scale=scale)

  def output_types(q, *_):
    batch, s_q, heads, _ = q.shape
    return (jax.ShapeDtypeStruct((batch, s_q, heads, LATENT_DIM), q.dtype),
            jax.ShapeDtypeStruct((batch, heads, s_q), jnp.float32))

  def attend(*args):
    return paged.per_platform(
        args, kernels={"cpu": with_cache(_mla_kernel_cpu),
                       "cuda": with_cache(functools.partial(_mla_kernel,
                                                            kv_split_size=kv_split_size))},
        reference=with_cache(mla_reference), output_types=output_types,
        implementation=implementation, reasons=reasons, what="MLA decode kernels")

  return sharding.on_explicit_mesh(attend, q, pools, page_table, cache_lengths, query_lengths,
                                   replicated_pools=True)


# A call traced where no GPU runs lowers for CUDA to the XLA composition (or
# fails with implementation="flash"): whether the Hopper kernel serves it is
# known only where the call is traced on that GPU.
_GPU_FROM_ELSEWHERE = ("an MLA decode call traced without a GPU has no GPU kernel; trace it on "
                       "the GPU that runs it, or use implementation=None")


def _mla_kernel(q, cache, page_table, cache_lengths, query_lengths, *, scale: float,
                kv_split_size: int | None):
  """The Hopper kernels: per (64 packed query rows, sequence, split) a
  partial result, merged in ``paged.merge_splits``'s fixed order."""
  s_q, heads = q.shape[1:3]
  fp8 = isinstance(cache, MlaFp8Cache)
  split_keys = kv_split_size or (_SPLIT_KEYS_ONE_TILE if s_q * heads <= _ROW_TILE else _SPLIT_KEYS)
  # A split longer than the table is one split of the table's width (no padding).
  split_pages = min(split_keys // PAGE_SIZE, max(page_table.shape[1], 1))
  return _split_kernel(_CUDA_TARGETS[fp8], q, cache, page_table, cache_lengths, query_lengths,
                       scale=scale, split_pages=split_pages, quantize_query=fp8)


def _mla_kernel_cpu(q, cache, page_table, cache_lengths, query_lengths, *, scale: float):
  """The CPU kernel (cuda_src/cpu/mla_cpu.cc): each sequence whole, in one split."""
  return _split_kernel(_CPU_TARGETS[isinstance(cache, MlaFp8Cache)], q, cache, page_table,
                       cache_lengths, query_lengths, scale=scale,
                       split_pages=max(page_table.shape[1], 1))


def _split_kernel(target, q, cache, page_table, cache_lengths, query_lengths, *, scale: float,
                  split_pages: int, quantize_query: bool = False):
  """A kernel call over splits of ``split_pages`` pages of each sequence,
  per shard, and the splits merged; ``quantize_query``: see ``_ffi_call``."""
  batch, s_q, heads, _ = q.shape
  max_pages = page_table.shape[1]
  splits = max(-(-max_pages // split_pages), 1)
  # Lengths clip to the table (as in the composition); its padding is never read.
  cache_lengths = jnp.clip(cache_lengths, 0, max_pages * PAGE_SIZE)
  table = jnp.pad(page_table, [(0, 0), (0, splits * split_pages - max_pages)])
  pools = jax.tree.leaves(cache)
  kernel = sharding.paged_partitioned(
      functools.partial(_ffi_call, target, pools=len(pools), scale=scale,
                        split_pages=split_pages, quantize_query=quantize_query),
      splits, pool_ranks=tuple(pool.ndim for pool in pools))
  out, lse = kernel(q, *pools, table, query_lengths, cache_lengths)
  return paged.merge_splits(out.reshape(batch, splits, s_q, heads, LATENT_DIM),
                            lse.reshape(batch, splits, heads, s_q))


def _ffi_call(target, q, *operands, pools: int, scale: float, split_pages: int,
              quantize_query: bool):
  """One kernel call on (the local shards of) ``q, *pools, table, q_lens,
  kv_lens``: out ``[batch * splits, s_q, heads, 512]`` and lse ``[batch *
  splits, heads, s_q]``. With ``quantize_query`` (the FP8 cache's Hopper
  kernel) q goes in as its three parts from ``quantize_latent``, per token and
  head, so that its codes are the reference's bit for bit on any shard."""
  batch, s_q, heads, _ = q.shape
  splits = operands[pools].shape[1] // split_pages
  out_types = (jax.ShapeDtypeStruct((batch * splits, s_q, heads, LATENT_DIM), q.dtype),
               jax.ShapeDtypeStruct((batch * splits, s_q, heads), jnp.float32))
  out, lse = jax.ffi.ffi_call(target, out_types)(
      *(quantize_latent(q) if quantize_query else (q,)), *operands, scale=np.float32(scale),
      split_pages=np.int32(split_pages))
  return out, jnp.swapaxes(lse, 1, 2)


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
  """Why the Hopper kernel cannot serve this call on this GPU, or None."""
  fp8 = isinstance(cache, MlaFp8Cache)
  if not _CUDA_REGISTERED[fp8]:
    return (f"this installation holds no MLA decode kernel for GPUs for the "
            f"{'FP8' if fp8 else 'bfloat16 / float16'} cache")
  capability = ffi.gpu_compute_capability()
  if capability is None or capability[0] != 9:
    return f"the MLA decode kernel needs a Hopper GPU (compute capability 9.x), got {capability}"
  return _cpu_unavailable_reason(cache)


def _cpu_unavailable_reason(cache) -> str | None:
  """Why the CPU kernel cannot serve this call, or None (the Hopper kernel's
  last condition too)."""
  if jax.tree.leaves(cache)[0].shape[0] == 0:
    return "the MLA decode kernels need a cache of at least one page"
  return None


def _check_scale(scale) -> float:
  if scale is None:
    raise ValueError("scale must be given: MLA's softmax scale comes from the un-absorbed head "
                     "dim, not from the cache's 576 columns (DeepSeek-V2/V3: (128 + 64) ** -0.5, "
                     "times mscale ** 2 with YaRN)")
  return validation.check_scale(scale, HEAD_DIM)


def _check_kv_split_size(kv_split_size) -> int | None:
  if kv_split_size is not None and not validation.is_positive_multiple(kv_split_size, PAGE_SIZE):
    raise ValueError(f"kv_split_size must be None or a positive multiple of the page size "
                     f"{PAGE_SIZE}, got {kv_split_size!r}")
  return None if kv_split_size is None else int(kv_split_size)


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
