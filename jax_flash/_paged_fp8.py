"""The FP8 paged KV cache (docs/fp8.md): pages of float8_e4m3fn codes with
one float32 scale per token and kv head.

``paged_attention`` and ``write_paged_cache`` take an ``Fp8Pages`` in place
of each pool. On a Hopper GPU with float16 / bfloat16 queries the paged
kernel reads the codes and scales of the pages itself
(cuda_src/fwd_sm90/paged_fp8.py); elsewhere each sequence's pages are
gathered, dequantised to float32 and run through the float32 paged call
(the CPU kernel on a CPU, the XLA composition elsewhere).
"""

import ctypes
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_flash import _ffi as ffi
from jax_flash import _fp8 as fp8
from jax_flash import _gpu_support

KERNEL_TARGET = "jax_flash_gpu_paged_fp8_fwd_v1"
_JF_DTYPES = {jnp.dtype(jnp.float16): 0, jnp.dtype(jnp.bfloat16): 1}  # kernel_api.h: JfDtype


_CUDA_REGISTERED = ffi.register_cuda_handler(
    "JaxFlashPagedFp8FwdCuda", KERNEL_TARGET,
    lambda library: getattr(library, "jax_flash_fwd_sm90_paged_fp8_has_variant", None) is not None)


def kernel_unavailable_reason(q_dtype, head_dim: int, head_dim_v: int) -> str | None:
  """Why the Hopper FP8-cache kernel cannot serve a call here, or None."""
  if not _CUDA_REGISTERED:
    return "this installation holds no Hopper kernel for the FP8 paged cache"
  reason = _gpu_support.gpu_unavailable_reason()
  if reason is not None:
    return reason
  capability = ffi.gpu_compute_capability()
  if capability is None or capability[0] != 9:
    return ("the FP8 paged kernel needs a Hopper GPU (compute capability 9.x), found "
            f"{capability}")
  dtype = jnp.dtype(q_dtype)
  if dtype not in _JF_DTYPES:
    return f"the FP8 paged kernel takes float16 or bfloat16 q, got {dtype.name}"
  has_variant = ffi._cuda_library.jax_flash_fwd_sm90_paged_fp8_has_variant
  has_variant.argtypes = (ctypes.c_int32,) * 3
  if not has_variant(_JF_DTYPES[dtype], head_dim, head_dim_v):
    return (f"no FP8 paged kernel for head_dim {head_dim}, head_dim_v {head_dim_v} (this "
            "build: 64 and 128, head_dim_v == head_dim)")
  return None


class Fp8Pages(NamedTuple):
  """One pool of an FP8 paged cache: token ``i`` of page ``p``, kv head
  ``h`` is ``values[p, i, h] * scales[p, h, i]``.

  Attributes:
    values: float8_e4m3fn ``[num_pages, page_size, heads_kv, head_dim]``,
      the bf16 cache's layout (a token's row of every head contiguous).
    scales: float32 ``[num_pages, heads_kv, page_size]``, each token and
      head's ``amax * (1/448)`` (``quantize_fp8``'s rule). Page-major, then
      head: the scales of one head's page are contiguous, so a kernel loads
      them with the page's key box (at least 16 tokens: 64 bytes, a
      TMA-sized row).
  """
  values: object
  scales: object

  @classmethod
  def zeros(cls, num_pages: int, page_size: int, heads_kv: int, head_dim: int) -> "Fp8Pages":
    """An empty pool: zero codes, unit scales."""
    return cls(jnp.zeros((num_pages, page_size, heads_kv, head_dim), fp8.FP8_DTYPE),
               jnp.ones((num_pages, heads_kv, page_size), jnp.float32))

  @classmethod
  def quantize(cls, pages) -> "Fp8Pages":
    """A pool of float pages ``[num_pages, page_size, heads_kv, dim]`` (a
    16-bit cache, say) quantised per token and head, as
    ``write_paged_cache`` quantises new tokens."""
    codes, scales = quantize_tokens(pages)
    return cls(codes, jnp.swapaxes(scales, 1, 2))


def quantize_tokens(x):
  """``(codes, scales)`` for new tokens ``x [batch, T, heads_kv, dim]``: per
  token and head, ``quantize_fp8``'s rule (NaN and Inf entries become NaN
  codes, outside the amax); scales ``[batch, T, heads_kv]``."""
  return fp8.quantize_fp8_rows(x)


def check_pages(name: str, pages) -> None:
  if not isinstance(pages, Fp8Pages):
    raise ValueError(f"{name} must be an Fp8Pages like the other pool, got "
                     f"{type(pages).__name__}")
  if jnp.ndim(pages.values) != 4:
    raise ValueError(f"{name}.values must have rank 4 [num_pages, page_size, heads_kv, dim], got "
                     f"shape {jnp.shape(pages.values)}")
  if jnp.result_type(pages.values) != fp8.FP8_DTYPE:
    raise ValueError(f"{name}.values must have dtype float8_e4m3fn, got "
                     f"{jnp.result_type(pages.values)}")
  num_pages, page_size, heads_kv, _ = jnp.shape(pages.values)
  if jnp.shape(pages.scales) != (num_pages, heads_kv, page_size):
    raise ValueError(f"{name}.scales must have shape {(num_pages, heads_kv, page_size)} "
                     f"[num_pages, heads_kv, page_size], got {jnp.shape(pages.scales)}")
  if jnp.result_type(pages.scales) != jnp.float32:
    raise ValueError(f"{name}.scales must have dtype float32, got "
                     f"{jnp.result_type(pages.scales)}")


def gather_dequantized(pages: Fp8Pages, page_table):
  """Each sequence's pages, in table order, dequantised to float32: a pool
  ``[batch * max_pages, page_size, heads_kv, dim]`` in which sequence ``b``
  owns pages ``b * max_pages ...`` (a page id outside the pool reads
  zeros, as in paged_attention)."""
  num_pages = pages.values.shape[0]
  ids = jnp.where((page_table >= 0) & (page_table < num_pages), page_table, num_pages).reshape(-1)
  if num_pages == 0:  # every id is outside the pool (jnp.take refuses an empty axis)
    return jnp.zeros((ids.shape[0], *pages.values.shape[1:]), jnp.float32)
  values = jnp.take(pages.values, ids, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
  scales = jnp.take(pages.scales, ids, axis=0, mode="fill", fill_value=0)
  return values * jnp.swapaxes(scales, 1, 2)[..., None]


def own_pages_table(page_table):
  """The table of ``gather_dequantized``'s pool: row ``b`` is ``b *
  max_pages + 0 ... max_pages - 1``."""
  batch, max_pages = page_table.shape
  return jnp.arange(batch * max_pages, dtype=jnp.int32).reshape(batch, max_pages)


def write_scales(scales, new_scales, pages, slots):
  """``scales [num_pages, heads_kv, page_size]`` with ``new_scales [batch,
  T, heads_kv]`` at (``pages``, ``slots``) ``[batch, T]``; a page id outside
  the pool drops the token."""
  heads = scales.shape[1]
  return scales.at[pages.reshape(-1), :, slots.reshape(-1)].set(
      new_scales.reshape(-1, heads), mode="drop", out_sharding=jax.typeof(scales).sharding)
