"""FP8 (float8_e4m3fn) attention, forward only, and the quantisation helpers
its callers need (docs/fp8.md).

``fp8_attention`` takes e4m3 q, k, v with float32 descale factors (the real
value is ``code * descale``): q and k per (batch, head) or per (batch, head,
block of rows), v per (batch, kv head). Today it runs the XLA composition
(dequantise, float32 attention), on a CPU jax_flash's CPU kernel on the
dequantised float32 inputs, and on a Hopper GPU the FP8 kernel
(_fp8_kernel.py) where it serves the call.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _api as api
from jax_flash import _fp8_kernel as fp8_kernel
from jax_flash import _reference as reference
from jax_flash import _validation as validation
from jax_flash._call import Mask

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
OUTPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
GRANULARITIES = ("tensor", "head", "block")
FORWARD_ONLY = ("FP8 attention is forward only: no gradient is defined (train in bfloat16 or "
                "float16 with jax_flash.attention)")


def quantize_fp8(x, *, granularity: str = "head", block_size: int = 128):
  """``(codes, descale)`` with ``x ~= codes * descale``: ``x [batch, seq,
  heads, head_dim]`` in float8_e4m3fn, one float32 descale per group.

  Groups (``granularity``): ``"tensor"``, the whole array (the descale is
  still returned per ``[batch, heads]``, every entry equal, the layout
  ``fp8_attention`` takes); ``"head"``, each (batch, head), descale
  ``[batch, heads]``; ``"block"``, each (batch, head, ``block_size`` rows
  of the sequence), descale ``[batch, heads, ceil(seq / block_size)]``.

  Each group's largest finite magnitude maps to 448: ``descale = amax *
  (1/448)``, ``codes = e4m3(x * (1 / descale))``, rounding to nearest even,
  each step one IEEE float32 operation (so numpy, XLA on any platform and a
  kernel's ``rcp.rn`` / ``cvt.rn.satfinite`` give the same codes). A group
  that is all zeros, or whose descale would fall below float32's normal
  range (amax below about 5e-36), gets a descale of 1. NaN and
  +-Inf entries become NaN codes (e4m3fn has no Inf) and do not enter the
  amax, so a poisoned position (padding, an unused slot) spoils only
  itself, not its group's scale.
  """
  if granularity not in GRANULARITIES:
    raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
  if jnp.ndim(x) != 4:
    raise ValueError(f"x must have rank 4 [batch, seq, heads, head_dim], got shape {jnp.shape(x)}")
  batch, seq, heads, _ = jnp.shape(x)
  x = jnp.asarray(x, jnp.float32)
  magnitude = jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)
  if granularity == "block":
    _check_block_size(block_size)
    blocks = -(-seq // block_size)
    padded = jnp.pad(magnitude, [(0, 0), (0, blocks * block_size - seq), (0, 0), (0, 0)])
    amax = jnp.max(padded.reshape(batch, blocks, block_size, heads, -1), axis=(2, 4))
    descale = _descale_of(jnp.swapaxes(amax, 1, 2))  # [B, H, blocks]
  else:
    amax = jnp.max(magnitude, axis=(1, 3))  # [B, H]
    if granularity == "tensor":
      amax = jnp.broadcast_to(jnp.max(amax), (batch, heads))
    descale = _descale_of(amax)
  inverse = 1 / _per_row(descale, seq, block_size if granularity == "block" else None)
  return _encode(x, inverse), descale


def quantize_fp8_rows(x):
  """``(codes, descale)`` for each row of the last axis of ``x`` as one
  group of ``quantize_fp8``'s rule (the same codes and descales); descale
  ``x.shape[:-1]``. No reshape, so a sharded ``x`` keeps its sharding."""
  x = jnp.asarray(x, jnp.float32)
  descale = _descale_of(jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0), axis=-1))
  return _encode(x, 1 / descale[..., None]), descale


def _encode(x, inverse):
  """e4m3 codes of ``x * inverse``, saturated; NaN codes where ``x`` is NaN
  or +-Inf."""
  codes = jnp.clip(x * inverse, -FP8_MAX, FP8_MAX)
  return jnp.where(jnp.isfinite(x), codes, jnp.nan).astype(FP8_DTYPE)


def _descale_of(amax):
  """``amax * (1/448)``, or 1 where that is below float32's normal range
  (a zero group; else ``1 / descale`` could overflow, and 0 * Inf is NaN)."""
  descale = amax * jnp.float32(1 / FP8_MAX)
  return jnp.where(descale >= jnp.finfo(jnp.float32).tiny, descale, jnp.float32(1))


def _per_row(descale, seq: int, block_size: int | None):
  """A descale ``[B, H]``, or ``[B, H, blocks]`` of ``block_size`` rows
  each, broadcast against ``[B, seq, H, D]``."""
  if block_size is None:
    return descale[:, None, :, None]
  per_token = jnp.repeat(descale, block_size, axis=2,
                         total_repeat_length=block_size * descale.shape[2])
  return jnp.swapaxes(per_token[:, :, :seq], 1, 2)[..., None]


def _check_block_size(block_size) -> int:
  is_int = isinstance(block_size, (int, np.integer)) and not isinstance(block_size, (bool, np.bool_))
  if not is_int or block_size <= 0:
    raise ValueError(f"block_size must be a positive int, got {block_size!r}")
  return int(block_size)


def dequantize_fp8(codes, descale, block_size: int | None = None):
  """Float32 ``codes * descale`` for the layouts of ``quantize_fp8``
  (``block_size`` for a per-block descale). A NaN code, or a non-finite
  descale, gives NaN or Inf there."""
  return codes.astype(jnp.float32) * _per_row(jnp.asarray(descale, jnp.float32),
                                              jnp.shape(codes)[1], block_size)


@functools.cache
def _hadamard(head_dim: int) -> np.ndarray:
  """The orthonormal Sylvester-Hadamard matrix of order ``head_dim``."""
  matrix = np.ones((1, 1))
  while matrix.shape[0] < head_dim:
    matrix = np.block([[matrix, matrix], [matrix, -matrix]])
  return (matrix / math.sqrt(head_dim)).astype(np.float32)


def hadamard_rotate(x):
  """``x`` rotated on its last axis by the orthonormal Hadamard matrix
  ``H / sqrt(head_dim)`` (a power of two), computed in float32, returned in
  x's dtype.

  Rotate q and k alike before quantising them (FlashAttention-3's
  "incoherent processing"): ``(q H)(k H)^T = q k^T``, so attention is
  unchanged up to rounding, while a channel that holds an outlier is spread
  over every channel of its row. V is not rotated (the output would be).
  A NaN or Inf in a row spreads over the whole row."""
  head_dim = jnp.shape(x)[-1]
  if head_dim < 1 or head_dim & (head_dim - 1):
    raise ValueError(f"hadamard_rotate needs a power-of-two last axis, got shape {jnp.shape(x)}")
  with jax.default_matmul_precision("highest"):
    rotated = jnp.asarray(x, jnp.float32) @ jnp.asarray(_hadamard(head_dim))
  return rotated.astype(jnp.result_type(x))


def _check_inputs(q, k, v, q_descale, k_descale, v_descale, block_size, output_dtype):
  dtypes = {name: jnp.result_type(x) for name, x in (("q", q), ("k", k), ("v", v))}
  for name, dtype in dtypes.items():
    if dtype != FP8_DTYPE:
      if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits == 8:
        raise NotImplementedError(f"fp8_attention takes float8_e4m3fn, got {name} {dtype}")
      raise ValueError("fp8_attention takes float8_e4m3fn q, k and v (quantize_fp8 makes "
                       f"them), got " + ", ".join(f"{n} {d}" for n, d in dtypes.items()))
  # check_qkv's shape rules, on zero-copy float32 stand-ins (it refuses FP8 dtypes).
  shapes = validation.check_qkv(*(np.broadcast_to(np.float32(0), np.shape(x)) for x in (q, k, v)))
  if block_size is not None:
    block_size = _check_block_size(block_size)
  expected = {
      "q_descale": (shapes.batch, shapes.heads_q, shapes.seq_q),
      "k_descale": (shapes.batch, shapes.heads_kv, shapes.seq_k),
      "v_descale": (shapes.batch, shapes.heads_kv, None),
  }
  descales = {}
  for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
    batch, heads, seq = expected[name]
    per_block = seq is not None and block_size is not None
    shape = (batch, heads, -(-seq // block_size)) if per_block else (batch, heads)
    layout = ("[batch, heads, ceil(seq / block_size)]" if per_block else
              "[batch, heads_q]" if name == "q_descale" else "[batch, heads_kv]")
    if x is None:
      raise ValueError(f"{name} is required: float32 {layout} {shape}, the factor that turns "
                       "the FP8 codes back into values (quantize_fp8 returns it)")
    if jnp.shape(x) != shape:
      raise ValueError(f"{name} must have shape {shape} {layout}, got {jnp.shape(x)}")
    if jnp.result_type(x) != jnp.float32:
      raise ValueError(f"{name} must have dtype float32, got {jnp.result_type(x)}")
    descales[name] = jnp.asarray(x)
  if output_dtype is None or jnp.dtype(output_dtype) not in OUTPUT_DTYPES:
    raise ValueError(f"output_dtype must be bfloat16 or float16, got {output_dtype!r}")
  return shapes, descales, block_size


def _backend(implementation, platform: str, kernel_reason) -> str:
  """"kernel" (the Hopper FP8 kernel), "cpu" (jax_flash's CPU kernel on the
  dequantised inputs) or "xla". kernel_reason(): why the Hopper kernel
  cannot run the call, or None."""
  if implementation == "xla":
    return "xla"
  if implementation == "gpu" or (implementation in (None, "flash") and platform == "gpu"):
    reason = kernel_reason()
    if reason is None:
      return "kernel"
    if implementation is None:
      return "xla"
    raise NotImplementedError(f"implementation={implementation!r}: {reason}; implementation=None "
                              "runs the XLA composition (dequantised, float32)")
  if implementation == "cpu" or platform == "cpu":
    return "cpu"
  if implementation == "flash":
    raise NotImplementedError(f"implementation='flash': jax_flash has no FP8 kernel for "
                              f"platform {platform!r}")
  return "xla"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _forward_only(compute, *arrays):
  return compute(*arrays)


def _forward_only_fwd(compute, *arrays):
  return compute(*arrays), None


def _forward_only_bwd(compute, residuals, cotangents):
  raise NotImplementedError(FORWARD_ONLY)


_forward_only.defvjp(_forward_only_fwd, _forward_only_bwd)


def fp8_attention(q, k, v, q_descale, k_descale, v_descale, *, causal: bool = False,
                  window=None, scale: float | None = None, query_seq_lengths=None,
                  key_value_seq_lengths=None, segment_ids=None, block_size: int | None = None,
                  output_dtype=jnp.bfloat16, return_lse: bool = False,
                  implementation: str | None = None):
  """Attention over float8_e4m3fn q, k, v (forward only; docs/fp8.md).

  Computes ``jax_flash.attention`` of the dequantised inputs ``q *
  q_descale``, ``k * k_descale``, ``v * v_descale``, in float32, and
  rounds the output once to ``output_dtype``.

  Args:
    q, k, v: float8_e4m3fn, ``attention``'s layouts and GQA rule
      (``quantize_fp8`` makes them; ``hadamard_rotate`` q and k first to
      spread outlier channels).
    q_descale: float32 ``[batch, heads_q]``, or with ``block_size``
      ``[batch, heads_q, ceil(seq_q / block_size)]``.
    k_descale: float32 ``[batch, heads_kv]``, or with ``block_size``
      ``[batch, heads_kv, ceil(seq_k / block_size)]``.
    v_descale: float32 ``[batch, heads_kv]`` (V's rows lie on the
      reduction axis of ``P V``: a per-row scale there would have to be
      folded into P, so V has one per head).
    block_size: rows per descale block of q and k; ``None``: one descale
      per (batch, head).
    causal, window, scale, query_seq_lengths, key_value_seq_lengths,
      segment_ids: as in ``jax_flash.attention``.
    output_dtype: ``jnp.bfloat16`` (default) or ``jnp.float16``.
    return_lse: also return the float32 log-sum-exp ``[batch, heads_q,
      seq_q]`` of the scaled logits of the dequantised inputs.
    implementation: ``None`` runs jax_flash's CPU kernel on a CPU, the
      Hopper FP8 kernel on a Hopper GPU where it serves the call (head dims
      64 / 128 / 256, one descale per (batch, head), no segment ids), and
      the XLA composition elsewhere; ``"flash"`` raises
      ``NotImplementedError`` where no kernel serves it; ``"cpu"``;
      ``"xla"``.

  Forward only: ``jax.grad`` through it raises ``NotImplementedError``.
  NaN semantics of ``attention`` on the dequantised values: a NaN code (or
  a non-finite descale) reaches exactly the rows that see its position.

  Returns:
    ``out [batch, seq_q, heads_q, head_dim_v]`` in ``output_dtype``, or
    ``(out, lse)``.
  """
  validation.check_implementation(implementation)
  shapes, descales, block_size = _check_inputs(q, k, v, q_descale, k_descale, v_descale, block_size,
                                   output_dtype)
  scale = validation.check_scale(scale, shapes.head_dim)
  window = validation.check_window(window, "window")
  return_lse = validation.check_flag(return_lse, "return_lse")
  mask = Mask.of(causal=validation.check_flag(causal, "causal"), window=window,
                 diag_offset=shapes.seq_k - shapes.seq_q)
  q_lens = validation.check_lengths(query_seq_lengths, "query_seq_lengths", shapes.batch)
  kv_lens = validation.check_lengths(key_value_seq_lengths, "key_value_seq_lengths", shapes.batch)
  segment_ids = validation.check_segment_ids(segment_ids, shapes)
  kernel_reason = lambda: fp8_kernel.unavailable_reason(
      output_dtype, shapes.head_dim, shapes.head_dim_v, shapes.seq_k, block_size, segment_ids)
  backend = _backend(implementation, api._platform_of(q, k, v), kernel_reason)

  def compute(q, k, v, q_descale, k_descale, v_descale, q_lens, kv_lens, q_ids, kv_ids):
    if backend == "kernel":
      full = lambda lens, seq: jnp.full(shapes.batch, seq, jnp.int32) if lens is None else lens
      return fp8_kernel.fp8_forward(q, k, v, q_descale, k_descale, v_descale,
                                    full(q_lens, shapes.seq_q), full(kv_lens, shapes.seq_k),
                                    scale=scale, output_dtype=output_dtype,
                                    **dataclasses.asdict(mask))
    q32, k32 = dequantize_fp8(q, q_descale, block_size), dequantize_fp8(k, k_descale, block_size)
    v32 = dequantize_fp8(v, v_descale)
    if backend == "xla":
      with jax.default_matmul_precision("highest"):  # float32 products, also where TF32 would run
        return reference.attention_reference(q32, k32, v32, scale=scale, q_lens=q_lens,
                                             kv_lens=kv_lens, q_segment_ids=q_ids,
                                             kv_segment_ids=kv_ids, **dataclasses.asdict(mask))
    return api._attention(q32, k32, v32, shapes, scale=scale, mask=mask, q_lens=q_lens,
                          kv_lens=kv_lens, segment_ids=(q_ids, kv_ids),
                          implementation=implementation)

  out, lse = _forward_only(compute, q, k, v, descales["q_descale"], descales["k_descale"],
                           descales["v_descale"], q_lens, kv_lens, *segment_ids)
  out = out.astype(output_dtype)
  return (out, lse) if return_lse else out
