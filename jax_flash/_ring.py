"""Ring attention: context parallelism over a sequence sharded across devices.

Inside ``shard_map`` every device holds one block of the sequence of q, k and
v. The K/V blocks travel around the ring of devices (``ppermute`` to the next
device); each device attends its queries to every block in turn and merges
the partial results by their log-sum-exps. The next hop is issued before the
current block is computed, so the transfer can overlap the kernel.

The backward is a second ring: K/V travel again, now with their dK/dV
accumulators, which arrive back at the block's owner after a full turn. Each
block pair's gradients come from the backward kernel called with the global
lse and ``delta``, which makes its probabilities the global ones, so no block
recomputes the forward.

Layouts (where the sequence positions live):

* ``"contiguous"``: device ``i`` of ``n`` holds positions ``[i L, (i+1) L)``.
* ``"zigzag"``: the sequence is cut into ``2n`` chunks and device ``i`` holds
  chunks ``i`` and ``2n-1-i``. Under a causal mask every device then does the
  same work (one early and one late chunk). ``to_zigzag`` / ``from_zigzag``
  permute a sequence into and out of this order.

Packed documents: the kv segment ids travel with their K/V block, and each
kernel call gets the ids of its two chunks and the document bounds computed
within them, so the kernels skip the tiles between documents as in
``jax_flash.attention``.

Each device splits its blocks into chunks (one or two) and runs one kernel
call per (query chunk, key chunk) pair. Which kernel call a pair needs depends
on how far apart the two chunks are in the sequence; the device index is only
known at run time, so each pair picks among the precomputed calls with
``lax.switch``: fully masked pairs are skipped, fully visible pairs run
unmasked, the rest run with the diagonal offset and window of their distance.

The zig-zag causal ring (the load-balanced one, and the one long-context
training uses) has a fixed shape instead: on its own block a device runs two
causal calls (its late chunk sees the whole block through one bottom-right
causal mask); on every other block exactly two chunk pairs
are visible, both in full: its late queries against the block's early keys,
and either its early queries against the early keys (the block comes from an
earlier device) or its late queries against the late keys (a later device).
So each step runs two unmasked calls, the second on the chunks picked by a
dynamic slice, with no branch: XLA's GPU conditionals copy the branch index
to the host and wait for it, which left the GPUs idle at every pair. The
partial results are merged once, at the end.
"""

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flash import _api as api
from jax_flash import _segments as segments
from jax_flash import _sharding as sharding
from jax_flash import _validation as validation
from jax_flash._call import UNMASKED, KernelCall, Mask, MaskOperands, sink_operand
from jax_flash._sinks import add_sinks

LAYOUTS = ("contiguous", "zigzag")
_CAUSAL = Mask(window_right=0)


@dataclasses.dataclass(frozen=True)
class _Ring:
  """The static description of one ring (hashable: a custom_vjp static arg)."""

  axis_name: Hashable
  axis_size: int
  layout: str
  chunk_q: int  # query positions per chunk
  chunk_k: int  # key positions per chunk
  backend: str
  scale: float
  mask: Mask  # on the global sequence (self-attention: diag_offset 0)
  softcap: float = 0.0
  deterministic: bool = False

  def call(self, mask: Mask) -> KernelCall:
    return KernelCall(self.backend, self.scale, mask, softcap=self.softcap,
                      deterministic=self.deterministic)

  @property
  def zigzag_causal(self) -> bool:
    """Whether the fixed zig-zag causal schedule applies (module docstring)."""
    return (self.layout == "zigzag" and self.mask == _CAUSAL
            and self.chunk_q == self.chunk_k)

  @property
  def chunks_per_device(self) -> int:
    return 2 if self.layout == "zigzag" else 1

  @property
  def num_chunks(self) -> int:
    return self.axis_size * self.chunks_per_device

  def chunk_indices(self, device) -> list:
    """The sequence chunk indices that ``device`` (possibly traced) holds."""
    if self.layout == "zigzag":
      return [device, self.num_chunks - 1 - device]
    return [device]

  def pair_calls(self) -> tuple[np.ndarray, list]:
    """For each chunk distance ``d = q_chunk - k_chunk`` (offset by
    ``num_chunks - 1``), the index of its call in the returned list; a call is
    a KernelCall or None for a fully masked pair."""
    unmasked = self.call(UNMASKED)
    calls, table = [None], []
    for d in range(1 - self.num_chunks, self.num_chunks):
      call = self._call_at(d, unmasked)
      if call not in calls:
        calls.append(call)
      table.append(calls.index(call))
    return np.asarray(table, np.int32), calls

  def _call_at(self, d: int, unmasked: KernelCall):
    if not self.mask.windowed:
      return unmasked
    # Row r sees column t when lo <= t - r - offset <= hi; across a chunk
    # pair t - r spans [-(c-1), c-1].
    c, offset = self.chunk_q, d * self.chunk_q
    left, right = self.mask.window_left, self.mask.window_right
    lo = -left if left >= 0 else -np.inf
    hi = right if right >= 0 else np.inf
    u_min, u_max = -(c - 1) - offset, (c - 1) - offset
    if u_max < lo or u_min > hi:
      return None
    if u_min >= lo and u_max <= hi:
      return unmasked
    return self.call(dataclasses.replace(self.mask, diag_offset=offset))


def _split(x, parts: int, axis: int) -> list:
  return jnp.split(x, parts, axis=axis) if parts > 1 else [x]


def _concat(xs: list, axis: int):
  return jnp.concatenate(xs, axis=axis) if len(xs) > 1 else xs[0]


def _hop(ring: _Ring, *xs):
  """Sends each array (None passes through) to the next device of the ring.

  Arrays of one dtype travel as one flat buffer: XLA hides at most one
  transfer at a time behind the kernels and runs the others synchronously
  (measured on 4 H200s: the ring forward's V waited while K overlapped)."""
  perm = [(d, (d + 1) % ring.axis_size) for d in range(ring.axis_size)]
  out = list(xs)
  for dtype in dict.fromkeys(x.dtype for x in xs if x is not None):
    group = [i for i, x in enumerate(xs) if x is not None and x.dtype == dtype]
    buffer = _concat([xs[i].reshape(-1) for i in group], 0)
    buffer = jax.lax.ppermute(buffer, ring.axis_name, perm)
    offsets = np.cumsum([0] + [xs[i].size for i in group])
    for i, start, stop in zip(group, offsets[:-1], offsets[1:]):
      out[i] = buffer[start:stop].reshape(xs[i].shape)
  return tuple(out)


def _split_segments(segment_ids, parts: int) -> list:
  """The per-chunk segment ids of a block; [None] * parts without them."""
  return [None] * parts if segment_ids is None else _split(segment_ids, parts, 1)


def _masks(q, k, q_segments, kv_segments) -> MaskOperands:
  """The mask operands of one (query chunk, key chunk) call: whole lengths,
  document bounds that are positions within these two chunks, as the kernel
  indexes them."""
  lengths = lambda x: jnp.full((x.shape[0],), x.shape[1], jnp.int32)
  bounds = None if q_segments is None else segments.segment_bounds(q_segments, kv_segments)
  return MaskOperands.build(q.shape[:1], lengths(q), lengths(k), q_segments, kv_segments, bounds)


def _pair(ring: _Ring, d, run_call, skip, *operands):
  """Runs the kernel call of chunk distance ``d`` on ``operands``."""
  table, calls = ring.pair_calls()
  branches = [functools.partial(skip if call is None else run_call, call) for call in calls]
  index = jnp.asarray(table)[d + ring.num_chunks - 1]
  return jax.lax.switch(index, branches, *operands)


def _merge(out, lse, block_out, block_lse):
  """Combines two partial softmax results by their log-sum-exps."""
  new_lse = jnp.logaddexp(lse, block_lse)
  safe = jnp.where(jnp.isfinite(new_lse), new_lse, 0.0)
  weight = lambda x: jnp.swapaxes(jnp.exp(x - safe), -1, -2)[..., None]  # [B,N,T] -> [B,T,N,1]
  return out * weight(lse) + block_out.astype(jnp.float32) * weight(block_lse), new_lse


def _ring_forward(q, k, v, segment_ids, ring: _Ring):
  if ring.zigzag_causal:
    return _zigzag_causal_forward(q, k, v, segment_ids, ring)
  parts = ring.chunks_per_device
  device = jax.lax.axis_index(ring.axis_name)
  q_places, q_chunks = ring.chunk_indices(device), _split(q, parts, 1)
  q_segments, kv_segments = (None, None) if segment_ids is None else segment_ids
  q_segment_chunks = _split_segments(q_segments, parts)
  batch, _, heads_q, _ = q.shape

  def run_call(call, q, k, v, q_segments, kv_segments):
    return sharding.forward(q, k, v, _masks(q, k, q_segments, kv_segments),
                            sink_operand(None, q), call)

  def skip(call, q, k, v, q_segments, kv_segments):
    del call
    out = jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype)
    lse = jnp.full((batch, heads_q, q.shape[1]), -jnp.inf, jnp.float32)
    return sharding.match_varying((out, lse), (q, k, v, q_segments, kv_segments))

  def step(s, carry):
    k, v, kv_segments, outs, lses = carry
    next_k, next_v, next_kv_segments = _hop(ring, k, v, kv_segments)
    k_places = ring.chunk_indices((device - s) % ring.axis_size)
    k_chunks, v_chunks = _split(k, parts, 1), _split(v, parts, 1)
    kv_segment_chunks = _split_segments(kv_segments, parts)
    outs, lses = list(outs), list(lses)
    for a, q_chunk in enumerate(q_chunks):
      for b in range(parts):
        block = _pair(ring, q_places[a] - k_places[b], run_call, skip, q_chunk, k_chunks[b],
                      v_chunks[b], q_segment_chunks[a], kv_segment_chunks[b])
        outs[a], lses[a] = _merge(outs[a], lses[a], *block)
    return next_k, next_v, next_kv_segments, outs, lses

  outs = [jnp.zeros((*c.shape[:-1], v.shape[-1]), jnp.float32) for c in q_chunks]
  lses = [jnp.full((batch, heads_q, c.shape[1]), -jnp.inf, jnp.float32) for c in q_chunks]
  outs, lses = sharding.match_varying((outs, lses), (q, k, v, segment_ids))
  *_, outs, lses = jax.lax.fori_loop(0, ring.axis_size, step, (k, v, kv_segments, outs, lses))
  return _concat(outs, 1).astype(q.dtype), _concat(lses, -1)


def _ring_backward(q, k, v, segment_ids, dout, lse, delta, ring: _Ring):
  if ring.zigzag_causal:
    return _zigzag_causal_backward(q, k, v, segment_ids, dout, lse, delta, ring)
  parts = ring.chunks_per_device
  device = jax.lax.axis_index(ring.axis_name)
  q_places = ring.chunk_indices(device)
  q_chunks, dout_chunks = _split(q, parts, 1), _split(dout, parts, 1)
  lse_chunks, delta_chunks = _split(lse, parts, -1), _split(delta, parts, -1)
  q_segments, kv_segments = (None, None) if segment_ids is None else segment_ids
  q_segment_chunks = _split_segments(q_segments, parts)

  def run_call(call, q, k, v, dout, lse, delta, q_segments, kv_segments):
    return sharding.backward(q, k, v, dout, lse, delta, _masks(q, k, q_segments, kv_segments),
                             call)

  def skip(call, q, k, v, dout, lse, delta, q_segments, kv_segments):
    del call
    grads = (jnp.zeros(q.shape, jnp.float32), jnp.zeros_like(k), jnp.zeros_like(v))
    return sharding.match_varying(grads, (q, k, v, dout, lse, delta, q_segments, kv_segments))

  def step(s, carry):
    k, v, kv_segments, dk, dv, dqs = carry
    next_k, next_v, next_kv_segments = _hop(ring, k, v, kv_segments)
    k_places = ring.chunk_indices((device - s) % ring.axis_size)
    k_chunks, v_chunks = _split(k, parts, 1), _split(v, parts, 1)
    kv_segment_chunks = _split_segments(kv_segments, parts)
    dqs = list(dqs)
    dk_chunks = [jnp.float32(0)] * parts
    dv_chunks = [jnp.float32(0)] * parts
    for a in range(parts):
      for b in range(parts):
        dq_p, dk_p, dv_p = _pair(ring, q_places[a] - k_places[b], run_call, skip, q_chunks[a],
                                 k_chunks[b], v_chunks[b], dout_chunks[a], lse_chunks[a],
                                 delta_chunks[a], q_segment_chunks[a], kv_segment_chunks[b])
        dqs[a] = dqs[a] + dq_p
        dk_chunks[b] = dk_chunks[b] + dk_p.astype(jnp.float32)
        dv_chunks[b] = dv_chunks[b] + dv_p.astype(jnp.float32)
    # The accumulators travel with their block and are home after n hops.
    dk, dv = _hop(ring, dk + _concat(dk_chunks, 1), dv + _concat(dv_chunks, 1))
    return next_k, next_v, next_kv_segments, dk, dv, dqs

  dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
  dqs = [jnp.zeros(c.shape, jnp.float32) for c in q_chunks]
  dk, dv, dqs = sharding.match_varying((dk, dv, dqs), (q, k, v, dout, segment_ids))
  *_, dk, dv, dqs = jax.lax.fori_loop(0, ring.axis_size, step,
                                      (k, v, kv_segments, dk, dv, dqs))
  return _concat(dqs, 1), dk, dv


def _early_late(x, axis: int = 1):
  """A zig-zag block's (early chunk, late chunk); (None, None) for None."""
  return (None, None) if x is None else tuple(jnp.split(x, 2, axis=axis))


def _chunk_of(x, index, axis: int = 1):
  """Chunk ``index`` (0 early, 1 late; traced) of a zig-zag block; None for None."""
  if x is None:
    return None
  halves = x.reshape(*x.shape[:axis], 2, x.shape[axis] // 2, *x.shape[axis + 1:])
  return jax.lax.dynamic_index_in_dim(halves, index, axis=axis, keepdims=False)


def _after(values_and_dependencies):
  """The values, available only once the dependencies are computed. A ring
  step's hop must not start before the previous step's kernels: nothing else
  ties the chain of hops to the kernels, and XLA then runs all hops up front,
  one after the other, with no kernel to hide them behind."""
  return jax.lax.optimization_barrier(values_and_dependencies)


def _combine(blocks):
  """Merges partial softmax results [(out, lse), ...] by their log-sum-exps
  in one pass (each partial output is read once)."""
  lses = jnp.stack([lse for _, lse in blocks])
  total = jax.nn.logsumexp(lses, axis=0)
  safe = jnp.where(jnp.isfinite(total), total, 0.0)
  out = sum(out.astype(jnp.float32) * jnp.swapaxes(jnp.exp(lse - safe), -1, -2)[..., None]
            for out, lse in blocks)
  return out, total


def _zigzag_causal_forward(q, k, v, segment_ids, ring: _Ring):
  device = jax.lax.axis_index(ring.axis_name)
  q_segments, kv_segments = (None, None) if segment_ids is None else segment_ids
  q_early, q_late = _early_late(q)
  qs_early, qs_late = _early_late(q_segments)
  causal, full = ring.call(_CAUSAL), ring.call(UNMASKED)
  # The late chunk against its own whole block (early keys, then its own
  # chunk) is one bottom-right causal call: key j' of the block is visible
  # from row r iff j' <= r + chunk.
  late_on_own = ring.call(dataclasses.replace(_CAUSAL, diag_offset=ring.chunk_k))

  def attend(call, q, k, v, q_seg, kv_seg):
    return sharding.forward(q, k, v, _masks(q, k, q_seg, kv_seg), sink_operand(None, q), call)

  # Every partial result is kept (in the input dtype) and merged once at the
  # end: merging after each call cost a read and write of a float32
  # accumulator per call.
  early, late = [], []
  block = (k, v, kv_segments)
  for s in range(ring.axis_size):
    if s:
      block, _ = _after((block, (early[-1], late[-1])))
    next_block = _hop(ring, *block) if s + 1 < ring.axis_size else None
    k_early, v_early, ks_early = (_early_late(x)[0] for x in block)
    if s == 0:
      early.append(attend(causal, q_early, k_early, v_early, qs_early, ks_early))
      late.append(attend(late_on_own, q_late, *block[:2], qs_late, block[2]))
    else:
      late.append(attend(full, q_late, k_early, v_early, qs_late, ks_early))
      earlier = (device - s) % ring.axis_size < device
      chunk = jnp.where(earlier, 0, 1)
      out, lse = attend(full, _chunk_of(q, chunk), _chunk_of(block[0], chunk),
                        _chunk_of(block[1], chunk), _chunk_of(q_segments, chunk),
                        _chunk_of(block[2], chunk))
      early.append((out, jnp.where(earlier, lse, -jnp.inf)))
      late.append((out, jnp.where(earlier, -jnp.inf, lse)))
    block = next_block
  (out_early, lse_early), (out_late, lse_late) = _combine(early), _combine(late)
  out = jnp.concatenate([out_early, out_late], axis=1).astype(q.dtype)
  return out, jnp.concatenate([lse_early, lse_late], axis=-1)


def _add_to_chunk(halves, index, x):
  """halves [B, 2, chunk, ...] with x added to half ``index`` (traced)."""
  current = jax.lax.dynamic_index_in_dim(halves, index, axis=1, keepdims=False)
  return jax.lax.dynamic_update_index_in_dim(halves, current + x, index, axis=1)


def _halves(x):
  return x.reshape(x.shape[0], 2, x.shape[1] // 2, *x.shape[2:])


def _zigzag_causal_backward(q, k, v, segment_ids, dout, lse, delta, ring: _Ring):
  device = jax.lax.axis_index(ring.axis_name)
  q_segments, kv_segments = (None, None) if segment_ids is None else segment_ids
  # A query chunk's operands: (q, dout, lse, delta, segment ids), by sequence axis.
  row_operands = ((q, 1), (dout, 1), (lse, 2), (delta, 2), (q_segments, 1))
  early_rows, late_rows = (tuple(_early_late(x, axis)[half] for x, axis in row_operands)
                           for half in (0, 1))
  causal, full = ring.call(_CAUSAL), ring.call(UNMASKED)
  late_on_own = ring.call(dataclasses.replace(_CAUSAL, diag_offset=ring.chunk_k))  # as in the forward

  def grads(call, rows, k, v, kv_seg):
    q, dout, lse, delta, q_seg = rows
    dq, dk, dv = sharding.backward(q, k, v, dout, lse, delta, _masks(q, k, q_seg, kv_seg), call)
    return dq, dk.astype(jnp.float32), dv.astype(jnp.float32)

  block = (k, v, kv_segments)
  # dK / dV of the block in hand travel with it and are home after a full turn.
  dq, dk, dv = sharding.match_varying(
      (jnp.zeros(_halves(q).shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
       jnp.zeros(v.shape, jnp.float32)), (q, k, v, dout, segment_ids))
  for s in range(ring.axis_size):
    if s:
      block, dq = _after((block, dq))
    next_block = _hop(ring, *block) if s + 1 < ring.axis_size else None
    k_early, v_early, ks_early = (_early_late(x)[0] for x in block)
    if s == 0:
      dq_e, dk_e, dv_e = grads(causal, early_rows, k_early, v_early, ks_early)
      dq_l, dk_own, dv_own = grads(late_on_own, late_rows, *block)
      dq = dq + jnp.stack([dq_e, dq_l], axis=1)
      dk_block = _halves(dk_own).at[:, 0].add(dk_e)
      dv_block = _halves(dv_own).at[:, 0].add(dv_e)
    else:
      dq_l, dk_e, dv_e = grads(full, late_rows, k_early, v_early, ks_early)
      chunk = jnp.where((device - s) % ring.axis_size < device, 0, 1)
      rows = tuple(_chunk_of(x, chunk, axis) for x, axis in row_operands)
      dq_x, dk_x, dv_x = grads(full, rows, *(_chunk_of(x, chunk) for x in block))
      dq = _add_to_chunk(dq.at[:, 1].add(dq_l), chunk, dq_x)
      dk_block = _add_to_chunk(jnp.stack([dk_e, jnp.zeros_like(dk_e)], axis=1), chunk, dk_x)
      dv_block = _add_to_chunk(jnp.stack([dv_e, jnp.zeros_like(dv_e)], axis=1), chunk, dv_x)
    dk, dv = _hop(ring, dk + dk_block.reshape(k.shape), dv + dv_block.reshape(v.shape))
    block = next_block
  return dq.reshape(q.shape), dk, dv

@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring_attention(q, k, v, segment_ids, ring: _Ring):
  """``segment_ids``: None or the (q, kv) pair of this device's blocks."""
  return _ring_forward(q, k, v, segment_ids, ring)


def _ring_attention_fwd(q, k, v, segment_ids, ring):
  out, lse = _ring_forward(q, k, v, segment_ids, ring)
  return (out, lse), (q, k, v, segment_ids, out, lse)


def _ring_attention_bwd(ring, residuals, cotangents):
  q, k, v, segment_ids, out, lse = residuals
  dout, dlse = cotangents
  delta = jnp.einsum("btnh,btnh->bnt", dout.astype(jnp.float32), out.astype(jnp.float32))
  delta = delta - dlse.astype(jnp.float32)
  dq, dk, dv = _ring_backward(q, k, v, segment_ids, dout.astype(q.dtype), lse, delta, ring)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)


def ring_attention(q, k, v, *, axis_name, causal: bool = False, window=None,
                   scale: float | None = None, segment_ids=None, softcap: float | None = None,
                   sinks=None, deterministic: bool = False, layout: str = "contiguous",
                   return_lse: bool = False, implementation: str | None = None):
  """Attention over a sequence sharded along the mesh axis ``axis_name``.

  Call it inside ``shard_map`` (or use ``ring_attention_sharded``): q, k and
  v are this device's blocks ``[batch, seq_local, heads, head_dim]`` of
  sequences sharded the same way, in ``layout`` order (see the module
  docstring). Masks follow ``jax_flash.attention`` on the global sequence;
  ``causal`` and ``window`` need self-attention (equal block lengths, even
  ones for ``"zigzag"``). Use ``"zigzag"`` with ``causal`` to balance the
  work. GQA / MQA work as in ``attention``. ``segment_ids`` (packed
  documents) follow ``attention`` too, as this device's blocks: one int32
  ``[batch, seq_local]`` array or a ``(q_segment_ids, kv_segment_ids)`` pair,
  sharded and ordered like q and k. ``softcap`` and ``deterministic`` are
  those of ``attention`` (the ring adds the blocks' dQ in a fixed order, so
  with ``deterministic`` the whole backward repeats bitwise). ``sinks``
  (``attention``'s, for this device's ``heads_q`` query heads) join once,
  after the blocks are merged. ``implementation``: ``None``,
  ``"flash"``, ``"cpu"`` or ``"gpu"``; the ring always runs the kernels.

  Returns this device's block of ``out``, or ``(out, lse)`` (lse ``[batch,
  heads_q, seq_local]``).
  """
  validation.check_implementation(implementation)
  if implementation == "xla":
    raise NotImplementedError("ring_attention runs jax_flash's kernels; implementation='xla' "
                              "is not supported")
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  shapes = validation.check_qkv(q, k, v)
  scale = validation.check_scale(scale, shapes.head_dim)
  window = validation.check_window(window, "window")
  q_segments, kv_segments = validation.check_segment_ids(segment_ids, shapes)
  mask = Mask.of(causal=causal, window=window)
  if mask.windowed and shapes.seq_q != shapes.seq_k:
    raise ValueError("causal or windowed ring attention needs q and k/v blocks of one length "
                     f"(self-attention), got seq_q={shapes.seq_q}, seq_k={shapes.seq_k}")
  parts = 2 if layout == "zigzag" else 1
  if shapes.seq_q % parts or shapes.seq_k % parts:
    raise ValueError("the zigzag layout needs even local sequence lengths, got "
                     f"seq_q={shapes.seq_q}, seq_k={shapes.seq_k}")
  backend = api.select_backend(implementation or "flash", api._platform_of(q, k, v),
                               jnp.result_type(q), shapes)
  try:
    axis_size = jax.lax.axis_size(axis_name)
  except NameError:
    raise ValueError(f"ring_attention needs the mesh axis {axis_name!r} bound: call it inside "
                     "shard_map, or use ring_attention_sharded") from None
  ring = _Ring(axis_name=axis_name, axis_size=axis_size, layout=layout,
               chunk_q=shapes.seq_q // parts, chunk_k=shapes.seq_k // parts, backend=backend,
               scale=scale, mask=mask,
               softcap=validation.check_softcap(softcap),
               deterministic=validation.check_flag(deterministic, "deterministic"))
  sinks = validation.check_sinks(sinks, shapes.heads_q)
  segment_ids = None if q_segments is None else (q_segments, kv_segments)
  out, lse = _ring_attention(q, k, v, segment_ids, ring)
  if sinks is not None:
    out, lse = add_sinks(out, lse, sinks)
  return (out, lse) if return_lse else out


def ring_attention_sharded(q, k, v, *, mesh, seq_axis, batch_axis=None, head_axis=None,
                           causal: bool = False, window=None, scale: float | None = None,
                           segment_ids=None, softcap: float | None = None, sinks=None,
                           deterministic: bool = False, layout: str = "contiguous",
                           return_lse: bool = False, implementation: str | None = None):
  """``ring_attention`` on global arrays: the ``shard_map`` over ``mesh``
  done for you.

  q, k and v (``[batch, seq, heads, head_dim]``, in ``layout`` order) are
  sharded along ``seq_axis`` for the ring, and optionally along
  ``batch_axis`` (data parallel) and ``head_axis`` (tensor parallel, whole GQA
  groups: ``heads_kv`` must be a multiple of its size). ``segment_ids``
  (``[batch, seq]``, one array or a q / kv pair, in the same ``layout``
  order) are sharded like the sequence of q and k. ``sinks`` (float32
  ``[heads_q]``) are sharded like the heads. Mesh axes named nowhere are
  replicated. Works inside or outside ``jax.jit``.
  """
  # Checked on the global shapes here: inside shard_map the messages would
  # name the per-device blocks.
  shapes = validation.check_qkv(q, k, v)
  q_segments, kv_segments = validation.check_segment_ids(segment_ids, shapes)
  sinks = validation.check_sinks(sinks, shapes.heads_q)
  if head_axis is not None:
    shards = int(np.prod([mesh.shape[a] for a in sharding.axes_of(head_axis)]))
    heads_kv = np.shape(k)[2]
    if heads_kv % shards:
      raise NotImplementedError(
          f"head_axis={head_axis!r} shards heads {shards} ways, which splits GQA groups of "
          f"heads_kv={heads_kv} kv heads; use a head axis whose size divides heads_kv")
  spec, segment_spec = P(batch_axis, seq_axis, head_axis, None), P(batch_axis, seq_axis)
  arrays, in_specs = [q, k, v], [spec, spec, spec]
  if q_segments is not None:
    arrays += [q_segments, kv_segments]
    in_specs += [segment_spec, segment_spec]
  if sinks is not None:
    arrays.append(sinks)
    in_specs.append(P(head_axis))

  def kernel(q, k, v, *rest):
    segment_pair = tuple(rest[:2]) if q_segments is not None else None
    return ring_attention(q, k, v, axis_name=seq_axis, causal=causal, window=window,
                          scale=scale, segment_ids=segment_pair, softcap=softcap,
                          sinks=rest[-1] if sinks is not None else None,
                          deterministic=deterministic, layout=layout, return_lse=return_lse,
                          implementation=implementation)

  out_specs = (spec, P(batch_axis, head_axis, seq_axis)) if return_lse else spec
  if AxisType.Explicit in mesh.axis_types:
    # shard_map takes explicitly sharded inputs only in its in_specs' sharding.
    arrays = [jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(arrays, in_specs)]
  return jax.shard_map(kernel, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs)(
      *arrays)


def zigzag_indices(seq_len: int, num_devices: int) -> np.ndarray:
  """Positions in zigzag order: ``x[:, zigzag_indices(T, n)]`` puts chunks
  ``i`` and ``2n-1-i`` of the sequence side by side in block ``i``."""
  chunks = 2 * num_devices
  if seq_len % chunks:
    raise ValueError(f"the zigzag layout cuts the sequence into 2 * {num_devices} = {chunks} "
                     f"chunks; seq_len {seq_len} is not a multiple of {chunks}")
  size = seq_len // chunks
  order = [c for i in range(num_devices) for c in (i, chunks - 1 - i)]
  return np.concatenate([np.arange(c * size, (c + 1) * size) for c in order])


def to_zigzag(x, num_devices: int, axis: int = 1):
  """Permutes the sequence ``axis`` of ``x`` into zigzag order."""
  return _reorder(x, zigzag_indices(np.shape(x)[axis], num_devices), axis)


def from_zigzag(x, num_devices: int, axis: int = 1):
  """Undoes ``to_zigzag``."""
  return _reorder(x, np.argsort(zigzag_indices(np.shape(x)[axis], num_devices)), axis)


def _reorder(x, order, axis: int):
  """``x`` with ``axis`` permuted by ``order``; an array sharded over
  explicit mesh axes keeps its sharding (its gather has to be told)."""
  x = jnp.asarray(x)
  sharding = jax.typeof(x).sharding
  if AxisType.Explicit in sharding.mesh.axis_types:
    return x.at[(slice(None),) * axis + (order,)].get(out_sharding=sharding)
  return jnp.take(x, order, axis=axis)
