"""The plan of one kernel call: what runs, computed once from the call's
description (``_call.py``) and the shapes of the arrays that reach it (one
shard's, under sharding).

A forward plan says how wide V goes in (zero columns for the kernels that
need V as wide as K), whether the GQA heads pack into query rows
(``_head_packing``), whether and how the keys split (``_kv_split``) and who
adds the attention sinks; a backward plan also sizes the scratch buffers
the handler fills (dQ accumulators, the deterministic kernels' turn
counters). Whether the Hopper kernels serve the call is decided here, once
per plan, from the device (``_gpu_support``) and what the compiled library
says it holds (``_ffi``'s queries).
"""

import dataclasses
import math

import numpy as np

from jax_flash import _configs as configs
from jax_flash import _ffi as ffi
from jax_flash import _gpu_support as gpu_support
from jax_flash import _head_packing as head_packing
from jax_flash import _kv_split as kv_split
from jax_flash._call import UNMASKED, KernelCall, MaskOperands

# Query rows per dq_semaphore entry (kernel_api.h: the smallest query tile of
# the GPU backward kernels).
SEMAPHORE_ROWS = 32


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
  value_padding: int  # zero columns appended to V (and cut from the output)
  pack: int  # GQA query heads packed into each kv head's rows; 1: none
  inner: KernelCall  # the call the kernel gets: without a mask where the heads pack
  fixed_split: bool  # the batch-invariant split through the paged kernel (kv_split.py)
  parts: int  # key chunks of the grid split; 1: none
  kernel_adds_sinks: bool  # the Hopper forward adds the sinks in its epilogue


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
  on_xla: bool  # XLA's backward (reference.backward_like_kernels) instead of a kernel
  value_padding: int  # zero columns appended to V and dout (and cut from dV)
  pack: int
  inner: KernelCall
  dq_chains: int  # dQ accumulators (kernel_api.h: dq_chains)
  dq_tile_rows: int  # query rows of dq_accum's tiles; 0: dq_accum in q's layout
  first_turn_query_tile: int  # rows per turn where the first turn stores its dQ tile; 0: none

  def dq_shape(self, q_shape: tuple) -> tuple:
    """dq_accum's shape for rows of ``q_shape`` (after packing)."""
    *batch, seq_q, heads_q, head_dim = q_shape
    if self.dq_tile_rows:
      tiles = -(-seq_q // self.dq_tile_rows)
      return (*batch, self.dq_chains, heads_q, tiles, self.dq_tile_rows, head_dim)
    return (self.dq_chains, *q_shape) if self.dq_chains > 1 else tuple(q_shape)

  def semaphore_entries(self, seq_q: int) -> int:
    """dq_semaphore's turn counters per (batch, head) for ``seq_q`` rows
    (after packing): the deterministic kernels order their dQ additions
    through them."""
    return self.dq_chains * -(-seq_q // SEMAPHORE_ROWS) if self.inner.deterministic else 0


def _hopper(call: KernelCall) -> bool:
  return call.backend == "gpu" and gpu_support.is_hopper()


def _packing(q, k, call: KernelCall) -> tuple[int, KernelCall, tuple]:
  """(heads packed per row, the call the kernel gets, q's shape as it gets it)."""
  size = head_packing.group(q.shape, k.shape, call)
  if size == 1:
    return 1, call, q.shape
  batch, seq_q, heads_q, head_dim = q.shape
  return size, call.with_mask(UNMASKED), (batch, seq_q * size, heads_q // size, head_dim)


def plan_forward(q, k, v, masks: MaskOperands, call: KernelCall, *, sinks: bool) -> ForwardPlan:
  """The plan of a forward call on these arrays (or ShapeDtypeStructs);
  ``sinks``: whether the call has attention sinks."""
  if call.backend == "xla":  # reference.forward_like_kernels: nothing to plan
    return ForwardPlan(value_padding=0, pack=1, inner=call, fixed_split=False, parts=1,
                       kernel_adds_sinks=False)
  hopper = _hopper(call)
  has_segments = masks.has_segments
  padding = configs.BACKENDS[call.backend].value_padding(q.shape[-1], v.shape[-1])
  if padding and hopper and ffi.sm90_forward_has_variant(np.dtype(q.dtype).name, q.shape[-1],
                                                         v.shape[-1], has_segments):
    padding = 0  # a Hopper variant of these head dims takes V as it is (DeepSeek's 192 / 128)
  head_dim_v = v.shape[-1] + padding
  pack, inner, rows = _packing(q, k, call)
  fixed_split = kv_split.fixed_split_applies(rows, k.shape, head_dim_v, q.dtype, inner,
                                             has_segments=has_segments, hopper=hopper)
  parts = 1 if fixed_split else kv_split.parts(rows, k.shape, inner, has_segments=has_segments,
                                               target_ctas=gpu_support.split_target(call.backend))
  whole = pack == 1 and not fixed_split and parts == 1
  adds_sinks = (sinks and hopper and whole
                and _sm90_forward_serves(q, k, head_dim_v, has_segments))
  return ForwardPlan(value_padding=padding, pack=pack, inner=inner, fixed_split=fixed_split,
                     parts=parts, kernel_adds_sinks=adds_sinks)


def _sm90_forward_serves(q, k, head_dim_v: int, has_segments: bool) -> bool:
  """What jax_flash_fwd_sm90_can_implement asks (fwd_sm90/launch.cc:
  Serves), the variants from the library itself."""
  batch = math.prod(q.shape[:-3])
  return (k.shape[-3] > 0 and batch <= configs.MAX_GRID_YZ
          and q.shape[-2] <= configs.MAX_GRID_YZ
          and ffi.sm90_forward_has_variant(np.dtype(q.dtype).name, q.shape[-1], head_dim_v,
                                           has_segments))


def plan_backward(q, k, v, masks: MaskOperands, call: KernelCall) -> BackwardPlan:
  """The plan of a backward call on these arrays (or ShapeDtypeStructs)."""
  if call.backend == "xla" or (call.backward_on_xla and call.backend == "gpu"):
    return BackwardPlan(on_xla=True, value_padding=0, pack=1, inner=call, dq_chains=1,
                        dq_tile_rows=0, first_turn_query_tile=0)
  sm90, padding = _sm90_backward(q, v, masks, call)
  dims = (q.shape[-1], v.shape[-1] + padding)
  pack, inner, _ = _packing(q, k, call)
  chains = 1
  if sm90 and call.deterministic and not inner.mask.windowed:
    # Only the unmasked deterministic kernel uses more (bwd_sm90/warp_roles.py, "dQ chains").
    chains = ffi.sm90_deterministic_dq_chains(*dims, k.shape[-3])
  tile_rows = ffi.sm90_dq_tile_rows(*dims) if sm90 else 0
  first_turn = ffi.sm90_deterministic_query_tile(*dims) if sm90 and call.deterministic else 0
  return BackwardPlan(on_xla=False, value_padding=padding, pack=pack, inner=inner,
                      dq_chains=chains, dq_tile_rows=tile_rows, first_turn_query_tile=first_turn)


def _sm90_backward(q, v, masks: MaskOperands, call: KernelCall) -> tuple[bool, int]:
  """(whether the Hopper backward kernels serve the call, V's zero padding).
  What jax_flash_bwd_sm90_can_implement asks (bwd_sm90/launch.cc), the
  variants from the library itself: V as it is where a variant of these
  head dims exists (DeepSeek's 192 / 128), else as wide as K, as the sm80
  kernels take it."""
  head_dim, head_dim_v = q.shape[-1], v.shape[-1]
  padding = configs.BACKENDS[call.backend].value_padding(head_dim, head_dim_v)
  if not (_hopper(call) and math.prod(q.shape[:-3]) <= configs.MAX_GRID_YZ
          and v.shape[-2] <= configs.MAX_GRID_YZ):
    return False, padding
  has_variant = lambda dim_v: ffi.sm90_backward_has_variant(
      np.dtype(q.dtype).name, head_dim, dim_v, call.deterministic, masks.has_segments,
      call.softcap > 0)
  if has_variant(head_dim_v):
    return True, 0
  return has_variant(head_dim_v + padding), padding
