"""The Hopper FP8 kernel behind ``fp8_attention`` (cuda_src/fwd_sm90/
fp8_variant.py; docs/fp8.md, "The Hopper kernel").

FP8 WGMMA reads V with the keys contiguous, so each call first writes V
transposed, ``[batch, heads_kv, head_dim_v, keys]`` (one XLA pass over V),
with the keys of every 32-key slice in the order the kernel's P registers
hold them (``key_slot``) and zeros past each sequence's key length (the
kernel has no V checks of its own: a zero there keeps masked NaN codes
from reaching any row).
"""

import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _ffi as ffi

_TARGET = "jax_flash_gpu_fp8_fwd_v1"
KEY_SLICE = 32  # keys per FP8 WGMMA (cuda_src/fwd_sm90/fp8_operands.py: MMA_K)
_JF_DTYPES = {jnp.dtype(jnp.float16): 0, jnp.dtype(jnp.bfloat16): 1}  # kernel_api.h: JfDtype


def key_slot(c: int) -> int:
  """The column of key c (< 32) within its slice of the transposed V
  (fp8_operands.key_slot, the kernel's side of the same rule)."""
  j, q, e = c // 8, (c % 8) // 2, c % 2
  return 16 * (j // 2) + 4 * q + 2 * (j % 2) + e



_CUDA_REGISTERED = ffi.register_cuda_handler(
    "JaxFlashFp8FwdCuda", _TARGET,
    lambda library: getattr(library, "jax_flash_fwd_sm90_fp8_has_variant", None) is not None)


def unavailable_reason(output_dtype, head_dim: int, head_dim_v: int, seq_k: int,
                       block_size, segment_ids) -> str | None:
  """Why the kernel cannot run this call here, or None if it can."""
  if not _CUDA_REGISTERED:
    return "this installation holds no Hopper FP8 kernels"
  capability = ffi.gpu_compute_capability()
  if capability is None or capability[0] != 9:
    return f"the FP8 kernel needs a Hopper GPU (compute capability 9.x), found {capability}"
  has_variant = ffi._cuda_library.jax_flash_fwd_sm90_fp8_has_variant
  has_variant.argtypes = (ctypes.c_int32,) * 3
  if not has_variant(_JF_DTYPES[jnp.dtype(output_dtype)], head_dim, head_dim_v):
    return (f"no FP8 kernel for head_dim {head_dim}, head_dim_v {head_dim_v} and "
            f"output {jnp.dtype(output_dtype).name}")
  if block_size is not None:
    return "the FP8 kernel takes one descale per (batch, head) (block_size=None)"
  if any(ids is not None for ids in segment_ids):
    return "the FP8 kernel takes no segment_ids"
  if seq_k == 0:
    return "the FP8 kernel needs at least one key"
  return None


def value_transposed(v, kv_lens):
  """V [batch, seq_k, heads_kv, head_dim_v] e4m3 as the kernel reads it:
  ``[batch, heads_kv, head_dim_v, keys]``, keys rounded up to a multiple
  of 32, key c of each slice at key_slot(c), zeros from kv_lens[b] on.

  With c = 16 j1 + 8 j0 + 2 q + e, key_slot(c) = 16 j1 + 4 q + 2 j0 + e:
  the renaming swaps the j0 and q axes, so the whole layout is one
  transpose, with no gather along the keys."""
  batch, seq_k, heads_kv, head_dim_v = v.shape
  keys = max(-(-seq_k // KEY_SLICE), 1) * KEY_SLICE
  seen = jnp.arange(seq_k)[None, :] < kv_lens[:, None]
  v = jnp.where(seen[:, :, None, None], v, jnp.zeros((), v.dtype))
  v = jnp.pad(v, [(0, 0), (0, keys - seq_k), (0, 0), (0, 0)])
  v = v.reshape(batch, keys // KEY_SLICE, 2, 2, 4, 2, heads_kv, head_dim_v)  # b s j1 j0 q e h d
  return jnp.transpose(v, (0, 6, 7, 1, 2, 4, 3, 5)).reshape(batch, heads_kv, head_dim_v, keys)


def fp8_forward(q, k, v, q_descale, k_descale, v_descale, q_lens, kv_lens, *, scale: float,
                diag_offset: int, window_left: int, window_right: int, output_dtype):
  """``(out [batch, seq_q, heads_q, head_dim_v] output_dtype, lse [batch,
  heads_q, seq_q] float32)`` from the kernel; lengths int32 [batch]."""
  batch, seq_q, heads_q, _ = q.shape
  head_dim_v = v.shape[-1]
  out_types = (jax.ShapeDtypeStruct((batch, seq_q, heads_q, head_dim_v), output_dtype),
               jax.ShapeDtypeStruct((batch, heads_q, seq_q), jnp.float32))
  # The handler reads rank-4 operands: under vmap, one call per mapped entry.
  return jax.ffi.ffi_call(_TARGET, out_types, vmap_method="sequential")(
      q, k, value_transposed(v, kv_lens), q_lens, kv_lens, q_descale, k_descale, v_descale,
      scale=np.float32(scale), diag_offset=np.int32(diag_offset),
      window_left=np.int32(window_left), window_right=np.int32(window_right))
