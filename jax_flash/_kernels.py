"""One call's kernels: the description (``_call.py``) made into a plan
(``_plan.py``) on the arrays that reach the kernels (one shard's under
sharding), and the plan carried out around the FFI calls (``_ffi.py``):
V padded, GQA heads packed, keys split, the sinks added where the kernel
does not, the dQ scratch turned back into dQ."""

import functools
import operator

import jax
import jax.numpy as jnp

from jax_flash import _ffi as ffi
from jax_flash import _head_packing as head_packing
from jax_flash import _kv_split as kv_split
from jax_flash import _plan as plan
from jax_flash import _reference as reference
from jax_flash._call import KernelCall, MaskOperands, PerPlatform, sink_operand
from jax_flash._sinks import add_sinks


def forward(q, k, v, masks: MaskOperands, sinks, call: KernelCall | PerPlatform):
  """Runs the forward: returns (o [..., T, N, Hv], lse [..., N, T] f32), the
  sinks (_call.sink_operand) included."""
  if isinstance(call, KernelCall):
    return _forward_on(q, k, v, masks, sinks, call)
  *batch, seq_q, heads_q, _ = q.shape
  out_types = (jax.ShapeDtypeStruct((*batch, seq_q, heads_q, v.shape[-1]), q.dtype),
               jax.ShapeDtypeStruct((*batch, heads_q, seq_q), jnp.float32))
  return _per_platform(_forward_on, call, out_types, (q, k, v, masks, sinks))


def backward(q, k, v, dout, lse, delta, masks: MaskOperands, call: KernelCall | PerPlatform):
  """Runs the backward: returns (dq f32, dk, dv)."""
  args = (q, k, v, dout, lse, delta, masks)
  if isinstance(call, KernelCall):
    return _backward_on(*args, call)
  out_types = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype))
  return _per_platform(_backward_on, call, out_types, args)


def _per_platform(run, call: PerPlatform, out_types, args):
  """``run(*args, entry)`` with the entry of ``call`` for the lowering platform."""

  def branch(entry):
    # Inside shard_map every branch must give the same types, which match_varying makes so.
    if isinstance(entry, KernelCall):
      return lambda *a: ffi.match_varying(run(*a, entry), a)
    return lambda *a: ffi.match_varying(tuple(ffi._unsupported_p.bind(
        *(jnp.zeros(t.shape, t.dtype) for t in out_types), reason=entry)), a)

  return jax.lax.platform_dependent(*args, cpu=branch(call.cpu), cuda=branch(call.cuda),
                                    default=branch(call.other))


def _pad_last(x, padding: int):
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padding)]) if padding else x


def _with_sinks(out, lse, sinks):
  """A forward's (out, lse) with ``sinks`` (_call.sink_operand) added."""
  return add_sinks(out, lse, sinks[..., 0]) if sinks.shape[-1] else (out, lse)


def _forward_on(q, k, v, masks: MaskOperands, sinks, call: KernelCall):
  if call.backend == "xla":
    out, lse = reference.forward_like_kernels(q, k, v, masks.q_lens, masks.kv_lens, masks.q_ids,
                                              masks.kv_ids, **call.reference_args())
    return _with_sinks(out, lse, sinks)
  steps = plan.plan_forward(q, k, v, masks, call, sinks=sinks.shape[-1] > 0)
  head_dim_v = v.shape[-1]
  v = _pad_last(v, steps.value_padding)
  if steps.kernel_adds_sinks:
    out, lse = ffi.forward_kernel(q, k, v, masks, sinks, call)
    return out[..., :head_dim_v], lse
  if steps.pack > 1:
    masks = head_packing.pack_masks(masks, steps.pack)
    out, lse = _split_or_whole(head_packing.pack_rows(q, steps.pack), k, v, masks, steps)
    out, lse = head_packing.unpack_rows(out, steps.pack), head_packing.unpack_stats(lse, steps.pack)
  else:
    out, lse = _split_or_whole(q, k, v, masks, steps)
  return _with_sinks(out[..., :head_dim_v], lse, sinks)


def _split_or_whole(q, k, v, masks: MaskOperands, steps: plan.ForwardPlan):
  """The forward of (possibly packed) rows, without sinks, as ``steps`` split it."""
  if steps.fixed_split:
    return kv_split.fixed_split_forward(q, k, v, masks, steps.inner)
  if steps.parts > 1:
    return kv_split.split_forward(ffi.forward_kernel, q, k, v, masks, steps.inner, steps.parts)
  return ffi.forward_kernel(q, k, v, masks, sink_operand(None, q), steps.inner)


def _backward_on(q, k, v, dout, lse, delta, masks: MaskOperands, call: KernelCall):
  if call.backward_unavailable and call.backend == "gpu":
    raise NotImplementedError(call.backward_unavailable)
  steps = plan.plan_backward(q, k, v, masks, call)
  if steps.on_xla:
    return reference.backward_like_kernels(q, k, v, dout, lse, delta, masks.q_lens,
                                           masks.kv_lens, masks.q_ids, masks.kv_ids,
                                           **call.reference_args())
  # Zero columns of V and dout change neither dP nor dQ / dK; their dV
  # columns are cut off.
  head_dim_v = v.shape[-1]
  v, dout = _pad_last(v, steps.value_padding), _pad_last(dout, steps.value_padding)
  size = steps.pack
  if size > 1:
    rows = lambda x: head_packing.pack_rows(x, size)
    stats = lambda x: head_packing.pack_stats(x, size)
    masks = head_packing.pack_masks(masks, size)
    dq, dk, dv = _backward(rows(q), k, v, rows(dout), stats(lse), stats(delta), masks, steps)
    dq = head_packing.unpack_rows(dq, size)
  else:
    dq, dk, dv = _backward(q, k, v, dout, lse, delta, masks, steps)
  return dq, dk, dv[..., :head_dim_v]


def _backward(q, k, v, dout, lse, delta, masks: MaskOperands, steps: plan.BackwardPlan):
  """One backward kernel call on (possibly packed) rows; dQ from its scratch."""
  seq_q = q.shape[-3]
  chains, rows = steps.dq_chains, steps.dq_tile_rows
  dq, dk, dv, turns = ffi.backward_kernel(q, k, v, dout, lse, delta, masks, steps.inner,
                                          dq_shape=steps.dq_shape(q.shape),
                                          semaphore_entries=steps.semaphore_entries(seq_q))
  if rows:
    dq = jnp.moveaxis(_dq_from_tiles(dq, seq_q), -4, 0)  # chains first, as in q's layout
    if chains == 1:
      dq = dq[0]
  if steps.first_turn_query_tile:
    dq = _written_tiles_only(dq, turns, steps.first_turn_query_tile, chains)
  if chains > 1:
    dq = functools.reduce(operator.add, list(dq))  # in order: the same sum every run
  return dq, dk, dv


def _written_tiles_only(dq, turns, query_tile: int, chains: int):
  """dq ([chains,] *batch, seq_q, heads, dim) with zeros in the query tiles
  whose count of turns is 0 in `turns` ([*batch, heads, entries], entry
  tile x chains + chain; kernel_api.h: dq_semaphore). The Hopper
  deterministic kernels' first turn stores a tile, so dq_accum is not
  zeroed first and a tile no turn reached holds what the buffer held."""
  *batch, heads, _ = turns.shape
  seq_q = dq.shape[-3]
  tiles = -(-seq_q // query_tile)
  written = turns[..., :tiles * chains].reshape(*batch, heads, tiles, chains) > 0
  written = jnp.repeat(written, query_tile, axis=-2)[..., :seq_q, :]  # [*batch, heads, seq_q, chains]
  written = jnp.swapaxes(jnp.moveaxis(written, -1, 0), -1, -2)[..., None]  # [chains, *batch, seq_q, heads, 1]
  return jnp.where(written if chains > 1 else written[0], dq, 0.0)


def _dq_from_tiles(dq, seq_q: int):
  """[*lead, heads, tiles, 64, dim] in the element order of the Hopper
  kernels' dQ fragments (cuda_src/bwd_sm90/wgmma_views.py:
  store_dq_fragments) -> [*lead, seq_q, heads, dim]."""
  *lead, heads, tiles, rows, dim = dq.shape
  if rows != 64:
    raise NotImplementedError(f"dq_accum in tiles of {rows} query rows; the fragment order is that of 64")
  # A tile's floats by (WG, warp, column octet, row half, lane row, lane column, pair element).
  x = dq.reshape(*lead, heads, tiles, 2, 4, dim // 16, 2, 8, 4, 2)
  n = len(lead)
  rows_first = (*range(n), n + 1, n + 3, n + 5, n + 6, n, n + 2, n + 4, n + 7, n + 8)
  x = x.transpose(rows_first).reshape(*lead, tiles * rows, heads, dim)
  return x[..., :seq_q, :, :]
