"""Checks on user input, raising errors that name the argument, the expected
and the actual value. ``ValueError`` is a caller mistake;
``NotImplementedError`` is a valid request that a backend cannot serve."""

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = (None, "flash", "cpu", "gpu", "xla")
# The kernels index sequences and windows with int32.
INT32_LIMIT = 2**31
# Input dtypes some backend serves; XLA's composition covers all of them.
DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


@dataclasses.dataclass(frozen=True)
class Shapes:
  batch: int
  seq_q: int
  seq_k: int
  heads_q: int
  heads_kv: int
  head_dim: int
  head_dim_v: int


def _shape(x) -> tuple[int, ...]:
  return tuple(np.shape(x))


def check_qkv(q, k, v) -> Shapes:
  """Validates q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if np.ndim(x) != 4:
      layout = "[batch, seq_q, heads_q, head_dim]" if name == "q" else "[batch, seq_k, heads_kv, head_dim]"
      raise ValueError(f"{name} must have rank 4 {layout}, got shape {_shape(x)}")
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"{name} must have a floating dtype, got {dtype}")
    if dtype not in DTYPES:
      names = ", ".join(jnp.dtype(d).name for d in DTYPES)
      raise NotImplementedError(f"jax_flash takes {names} inputs, got {name} {dtype}; cast q, k "
                                "and v to one of them")
    if not all(isinstance(d, int) for d in _shape(x)):
      raise NotImplementedError(
          f"jax_flash needs static shapes (the kernels' masks and launch shapes are fixed when "
          f"lowering), got {name} shape {_shape(x)} with symbolic dimensions; export one module "
          "per shape")
  if not jnp.result_type(q) == jnp.result_type(k) == jnp.result_type(v):
    raise ValueError("q, k and v must share one dtype, got "
                     f"q {jnp.result_type(q)}, k {jnp.result_type(k)}, v {jnp.result_type(v)}")
  batch, seq_q, heads_q, head_dim = _shape(q)
  kb, seq_k, heads_kv, kdim = _shape(k)
  vb, vseq, vheads, head_dim_v = _shape(v)
  if kb != batch or vb != batch:
    raise ValueError(f"q, k and v must share the batch size: expected {batch}, "
                     f"got k {kb} and v {vb}")
  if kdim != head_dim:
    raise ValueError(f"k head_dim must equal q head_dim: expected {head_dim}, got {kdim}")
  if (vseq, vheads) != (seq_k, heads_kv):
    raise ValueError(f"v must match k in seq_k and heads_kv: expected ({seq_k}, {heads_kv}), "
                     f"got ({vseq}, {vheads})")
  if heads_kv == 0 or heads_q % heads_kv:
    raise ValueError(f"heads_q must be a multiple of heads_kv: got heads_q={heads_q}, "
                     f"heads_kv={heads_kv}")
  for label, dim in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
    if dim == 0:
      raise ValueError(f"{label} must be at least 1, got 0")
  for label, dim in (("batch", batch), ("seq_q", seq_q), ("seq_k", seq_k)):
    if dim >= INT32_LIMIT:
      raise ValueError(f"{label} must be below 2**31 (the kernels index with int32), got {dim}")
  return Shapes(batch, seq_q, seq_k, heads_q, heads_kv, head_dim, head_dim_v)


def is_traced(x) -> bool:
  return isinstance(x, jax.core.Tracer)


def _static_number(value, name: str, expected: str) -> float:
  """``value`` as a float: a Python or NumPy real number, or a concrete
  scalar array; no strings or bools, no traced values."""
  if is_traced(value):
    raise ValueError(f"{name} must be {expected}, got a traced value (it is a static kernel "
                     "parameter: pass it outside jit or as a static argument)")
  if isinstance(value, (bool, np.bool_)) or not (
      isinstance(value, numbers.Real) or (hasattr(value, "dtype") and np.ndim(value) == 0
                                          and jnp.issubdtype(value.dtype, jnp.number))):
    raise ValueError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")
  return float(value)


def check_scale(scale, head_dim: int) -> float:
  if scale is None:
    return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
  value = _static_number(scale, "scale", "None or a Python number")
  if not math.isfinite(value):
    raise ValueError(f"scale must be finite, got {value}")
  return value


def check_softcap(softcap) -> float:
  """0.0 for no cap, else the positive finite cap."""
  if softcap is None:
    return 0.0
  value = _static_number(softcap, "softcap", "None or a Python number")
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"softcap must be None or a finite number > 0, got {value}")
  return value


def check_flag(value, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
  return bool(value)


def _is_int(x) -> bool:
  return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def is_positive_multiple(x, multiple: int) -> bool:
  """Whether x is a Python or numpy integer (not a bool), positive, and a multiple of `multiple`."""
  return _is_int(x) and x > 0 and x % multiple == 0


def check_window(window, name: str) -> tuple[int, int]:
  """(left, right) with -1 for an unbounded side; accepts None entries."""
  if window is None:
    return -1, -1
  if _is_int(window):
    window = (window, window)
  if not isinstance(window, (tuple, list)) or len(window) != 2:
    raise ValueError(f"{name} must be None, an int or a (left, right) pair, got {window!r}")
  sides = []
  for side, size in zip(("left", "right"), window):
    if size is None or (_is_int(size) and size == -1):
      sides.append(-1)
    elif _is_int(size) and 0 <= size < INT32_LIMIT:
      sides.append(int(size))
    else:
      raise ValueError(f"{name} {side} size must be None or an int in [0, 2**31), got {size!r}")
  return sides[0], sides[1]


def check_lengths(lengths, name: str, batch: int):
  if lengths is None:
    return None
  if not isinstance(lengths, jax.Array):
    values = np.asarray(lengths)
    if values.dtype.kind in "iu" and values.size and not (
        np.all(values >= -INT32_LIMIT) and np.all(values < INT32_LIMIT)):
      raise ValueError(f"{name} must hold int32 values (below 2**31), got {values.tolist()}")
  lengths = jnp.asarray(lengths)
  if lengths.shape != (batch,):
    raise ValueError(f"{name} must have shape ({batch},), got {lengths.shape}")
  if lengths.dtype != jnp.int32:
    raise ValueError(f"{name} must have dtype int32, got {lengths.dtype}")
  return lengths


def check_sinks(sinks, heads_q: int):
  """None, or the attention sinks as a float32 [heads_q] array (one logit per
  query head; jax_flash/_sinks.py)."""
  if sinks is None:
    return None
  if not hasattr(sinks, "dtype"):
    raise ValueError(f"sinks must be None or a float32 array [heads_q={heads_q}], got "
                     f"{type(sinks).__name__}")
  if np.ndim(sinks) != 1:
    raise ValueError(f"sinks must have rank 1 [heads_q={heads_q}], got shape {_shape(sinks)}")
  if _shape(sinks) != (heads_q,):
    raise ValueError(f"sinks must have shape ({heads_q},) [heads_q], got {_shape(sinks)}")
  if jnp.result_type(sinks) != jnp.float32:
    raise ValueError(f"sinks must have dtype float32, got {jnp.result_type(sinks)}")
  return jnp.asarray(sinks)


def check_implementation(implementation, allowed=IMPLEMENTATIONS) -> None:
  if implementation not in allowed:
    raise ValueError(f"implementation must be one of {allowed}, got {implementation!r}")


def check_segment_ids(segment_ids, shapes: Shapes):
  """(q_segment_ids [B, T], kv_segment_ids [B, S]) int32, or (None, None).

  Accepts one [B, T] array for self-attention (T == S) or a pair.
  """
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be one [batch, seq] array or a (q_segment_ids, "
                       f"kv_segment_ids) pair, got a sequence of {len(segment_ids)}")
    q_ids, kv_ids = segment_ids
  else:
    if shapes.seq_q != shapes.seq_k:
      raise ValueError("one segment_ids array needs seq_q == seq_k; pass (q_segment_ids, "
                       f"kv_segment_ids), got seq_q={shapes.seq_q}, seq_k={shapes.seq_k}")
    q_ids = kv_ids = segment_ids
  checked = []
  for name, ids, seq in (("q_segment_ids", q_ids, shapes.seq_q),
                         ("kv_segment_ids", kv_ids, shapes.seq_k)):
    ids = jnp.asarray(ids)
    if ids.shape != (shapes.batch, seq):
      raise ValueError(f"{name} must have shape ({shapes.batch}, {seq}), got {ids.shape}")
    if ids.dtype != jnp.int32:
      raise ValueError(f"{name} must have dtype int32, got {ids.dtype}")
    checked.append(ids)
  return tuple(checked)


def check_offsets(cu_seqlens, name: str, total: int):
  """FlashAttention-style cumulative offsets: int32 [num_docs + 1]."""
  cu_seqlens = jnp.asarray(cu_seqlens)
  if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
    raise ValueError(f"{name} must have shape (num_docs + 1,) with num_docs >= 1, got "
                     f"{cu_seqlens.shape}")
  if cu_seqlens.dtype != jnp.int32:
    raise ValueError(f"{name} must have dtype int32, got {cu_seqlens.dtype}")
  try:
    concrete = np.asarray(cu_seqlens)
  except Exception:  # traced: checked by the caller's data pipeline, not here
    return cu_seqlens
  if concrete[0] != 0 or np.any(np.diff(concrete) < 0) or concrete[-1] > total:
    raise ValueError(f"{name} must start at 0, never decrease and end at most at the "
                     f"{total} packed tokens, got {concrete.tolist()}")
  return cu_seqlens
