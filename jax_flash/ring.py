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
"""

import dataclasses
import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flash import api, ffi, segments, sharding, validation

LAYOUTS = ("contiguous", "zigzag")


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
  window_left: int  # -1: unbounded
  window_right: int  # -1: unbounded

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
    unmasked = ffi.KernelCall(self.backend, self.scale, 0, -1, -1)
    calls, table = [None], []
    for d in range(1 - self.num_chunks, self.num_chunks):
      call = self._call_at(d, unmasked)
      if call not in calls:
        calls.append(call)
      table.append(calls.index(call))
    return np.asarray(table, np.int32), calls

  def _call_at(self, d: int, unmasked: ffi.KernelCall):
    if self.window_left < 0 and self.window_right < 0:
      return unmasked
    # Row r sees column t when lo <= t - r - offset <= hi; across a chunk
    # pair t - r spans [-(c-1), c-1].
    c, offset = self.chunk_q, d * self.chunk_q
    lo = -self.window_left if self.window_left >= 0 else -np.inf
    hi = self.window_right if self.window_right >= 0 else np.inf
    u_min, u_max = -(c - 1) - offset, (c - 1) - offset
    if u_max < lo or u_min > hi:
      return None
    if u_min >= lo and u_max <= hi:
      return unmasked
    return ffi.KernelCall(self.backend, self.scale, offset, self.window_left, self.window_right)


def _split(x, parts: int, axis: int) -> list:
  return jnp.split(x, parts, axis=axis) if parts > 1 else [x]


def _concat(xs: list, axis: int):
  return jnp.concatenate(xs, axis=axis) if len(xs) > 1 else xs[0]


def _lengths(x, size: int):
  return jnp.full((x.shape[0],), size, jnp.int32)


def _hop(ring: _Ring, *xs):
  """Sends each array (None passes through) to the next device of the ring."""
  perm = [(d, (d + 1) % ring.axis_size) for d in range(ring.axis_size)]
  return jax.lax.ppermute(xs, ring.axis_name, perm)


def _split_segments(segment_ids, parts: int) -> list:
  """The per-chunk segment ids of a block; [None] * parts without them."""
  return [None] * parts if segment_ids is None else _split(segment_ids, parts, 1)


def _segment_operands(q, q_segments, kv_segments):
  """The packed-document operands of one (query chunk, key chunk) call: the
  bounds are positions within these two chunks, as the kernel indexes them."""
  if q_segments is None:
    return ffi.no_segments(q)
  bounds = segments.segment_bounds(q_segments, kv_segments)
  return ffi.segment_operands(q_segments, kv_segments, *bounds)


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
  parts = ring.chunks_per_device
  device = jax.lax.axis_index(ring.axis_name)
  q_places, q_chunks = ring.chunk_indices(device), _split(q, parts, 1)
  q_segments, kv_segments = (None, None) if segment_ids is None else segment_ids
  q_segment_chunks = _split_segments(q_segments, parts)
  batch, _, heads_q, _ = q.shape

  def run_call(call, q, k, v, q_segments, kv_segments):
    return sharding.forward(q, k, v, _lengths(q, q.shape[1]), _lengths(k, k.shape[1]),
                            *_segment_operands(q, q_segments, kv_segments), call)

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
  parts = ring.chunks_per_device
  device = jax.lax.axis_index(ring.axis_name)
  q_places = ring.chunk_indices(device)
  q_chunks, dout_chunks = _split(q, parts, 1), _split(dout, parts, 1)
  lse_chunks, delta_chunks = _split(lse, parts, -1), _split(delta, parts, -1)
  q_segments, kv_segments = (None, None) if segment_ids is None else segment_ids
  q_segment_chunks = _split_segments(q_segments, parts)

  def run_call(call, q, k, v, dout, lse, delta, q_segments, kv_segments):
    return sharding.backward(q, k, v, dout, lse, delta, _lengths(q, q.shape[1]),
                             _lengths(k, k.shape[1]),
                             *_segment_operands(q, q_segments, kv_segments), call)

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
                   scale: float | None = None, segment_ids=None, layout: str = "contiguous",
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
  sharded and ordered like q and k. ``implementation``: ``None``,
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
  window_left, window_right = validation.check_window(window, "window")
  q_segments, kv_segments = validation.check_segment_ids(segment_ids, shapes)
  if causal:
    window_right = 0 if window_right < 0 else min(window_right, 0)
  masked = window_left >= 0 or window_right >= 0
  if masked and shapes.seq_q != shapes.seq_k:
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
               scale=scale, window_left=window_left, window_right=window_right)
  segment_ids = None if q_segments is None else (q_segments, kv_segments)
  out, lse = _ring_attention(q, k, v, segment_ids, ring)
  return (out, lse) if return_lse else out


def ring_attention_sharded(q, k, v, *, mesh, seq_axis, batch_axis=None, head_axis=None,
                           causal: bool = False, window=None, scale: float | None = None,
                           segment_ids=None, layout: str = "contiguous",
                           return_lse: bool = False, implementation: str | None = None):
  """``ring_attention`` on global arrays: the ``shard_map`` over ``mesh``
  done for you.

  q, k and v (``[batch, seq, heads, head_dim]``, in ``layout`` order) are
  sharded along ``seq_axis`` for the ring, and optionally along
  ``batch_axis`` (data parallel) and ``head_axis`` (tensor parallel, whole GQA
  groups: ``heads_kv`` must be a multiple of its size). ``segment_ids``
  (``[batch, seq]``, one array or a q / kv pair, in the same ``layout``
  order) are sharded like the sequence of q and k. Mesh axes named nowhere
  are replicated. Works inside or outside ``jax.jit``.
  """
  # Checked on the global shapes here: inside shard_map the messages would
  # name the per-device blocks.
  q_segments, kv_segments = validation.check_segment_ids(segment_ids,
                                                         validation.check_qkv(q, k, v))
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

  def kernel(q, k, v, *segment_pair):
    return ring_attention(q, k, v, axis_name=seq_axis, causal=causal, window=window,
                          scale=scale, segment_ids=segment_pair or None, layout=layout,
                          return_lse=return_lse, implementation=implementation)

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
  return jnp.take(x, zigzag_indices(np.shape(x)[axis], num_devices), axis=axis)


def from_zigzag(x, num_devices: int, axis: int = 1):
  """Undoes ``to_zigzag``."""
  inverse = np.argsort(zigzag_indices(np.shape(x)[axis], num_devices))
  return jnp.take(x, inverse, axis=axis)
