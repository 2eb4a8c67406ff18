"""Running the kernels on sharded arrays: batch (data parallel) and heads
(tensor parallel) sharding without communication.

Three ways an array reaches a kernel call sharded:

* ``Auto`` mesh axes under ``jax.jit``: each kernel call is wrapped in
  ``custom_partitioning`` with a Shardy sharding rule. Batch and head
  dimensions pass through, so the SPMD partitioner runs the kernel once per
  shard on the local slices and the outputs keep q's sharding. The query
  heads dimension is the compound factor ``(k g)`` (kv head, position in its
  group), which keeps each GQA group with its kv head. Unsupported shardings
  (sequence, head dim, a GQA group split across devices) raise
  ``NotImplementedError`` from the partitioner, at compile time, which XLA
  reports as a runtime error carrying the message.
* ``Explicit`` mesh axes (``jax.make_mesh``'s default), with or without
  ``jax.set_mesh``: the sharding is part of the arrays' types, so the kernel
  runs under ``shard_map`` on the arrays' mesh with the specs derived from
  q's, and unsupported shardings raise while tracing.
* Inside ``shard_map``: the calls run on the local blocks as they are; the
  kernel outputs are cast to vary over the same manual mesh axes as their
  inputs, so that ``check_vma=True`` (the default) and gradients type-check.

For a sharded sequence use ``jax_flash.ring_attention``.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flash import _ffi as ffi
from jax_flash import _kernels as kernels
from jax_flash._call import MASK_ARRAYS, MaskOperands

_LEADING = "b"  # factor name prefix for the batch dims (more than one under vmap)


# Re-exported for ring.py, which casts its merged results the same way.
match_varying = ffi.match_varying


def _spec(sharding, ndim: int) -> tuple:
  spec = tuple(sharding.spec)
  return spec + (None,) * (ndim - len(spec))


def axes_of(entry) -> tuple:
  return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _unsupported(direction: str, problem: str) -> NotImplementedError:
  return NotImplementedError(
      f"jax_flash {direction} kernel: {problem}. Shard q, k and v over batch and/or heads only "
      "(for sequence sharding use jax_flash.ring_attention inside shard_map).")


def check_specs(q_spec, k_spec, v_spec, axis_sizes, heads_kv: int, direction: str):
  """Raises NotImplementedError unless the specs shard only batch and whole
  GQA groups of heads, consistently; ``axis_sizes`` maps mesh axis names to
  sizes."""
  for name, spec in (("q", q_spec), ("k", k_spec), ("v", v_spec)):
    if spec[-3] is not None:
      raise _unsupported(direction, f"{name} is sharded along the sequence ({spec[-3]!r})")
    if spec[-1] is not None:
      raise _unsupported(direction, f"{name} is sharded along the head dim ({spec[-1]!r})")
  shards = int(np.prod([axis_sizes[a] for a in axes_of(q_spec[-2])]))
  if heads_kv % shards:
    raise _unsupported(direction, (
        f"the heads are sharded {shards} ways ({q_spec[-2]!r}), which splits GQA groups of "
        f"heads_kv={heads_kv} kv heads; shard heads over a divisor of heads_kv"))


def _plan(specs, axis_sizes, heads_kv: int, direction: str):
  """Checks the (q, k, v) specs and returns ``spec_of(array)``: the spec of
  every kernel operand and result, told apart by rank (q / k / v / out /
  gradients, lse / delta / sinks, segment ids and bounds, lengths). q's batch and heads sharding decides; k
  and v are resharded to it (a local slice when they are replicated)."""
  check_specs(*specs, axis_sizes, heads_kv, direction)
  batch, heads = specs[0][:-3], specs[0][-2]
  rank = len(specs[0])
  by_rank = {rank: P(*batch, None, heads, None), rank - 1: P(*batch, heads, None),
             rank - 2: P(*batch, None), rank - 3: P(*batch)}
  return lambda x: by_rank[x.ndim]


def _sharding_rule(operands: str, results: str):
  """A Shardy rule callable: the operand / result specs use ``B`` for the
  leading batch dims (one factor each) and ``(k g)`` for the query heads."""

  def rule(call, mesh, value_types, result_types):
    del call, mesh, result_types
    q_type, k_type = (mlir.ir.RankedTensorType(t) for t in value_types[:2])
    leading = " ".join(f"{_LEADING}{i}" for i in range(q_type.rank - 3))
    group = q_type.shape[-2] // k_type.shape[-2]
    spec = f"{operands} -> {results}".replace("B", leading)
    if group == 1:  # Shardy rejects a compound factor with a part of size 1
      return spec.replace("(k g)", "k"), {}
    return spec, {"g": group}

  return rule


def _partitioned(kernel, direction: str, operands: str, results: str):
  """Wraps ``kernel(*arrays, call)`` so that it partitions per shard."""

  @functools.partial(custom_partitioning, static_argnums=(len(operands.split(",")),))
  def run(*args):
    return kernel(*args)

  def partition(call, mesh, arg_shapes, result_shapes):
    q, k, v = arg_shapes[:3]
    spec_of = _plan([_spec(x.sharding, x.ndim) for x in (q, k, v)], dict(mesh.shape),
                    k.shape[-2], direction)
    sharding_of = lambda x: NamedSharding(mesh, spec_of(x))
    return (mesh, lambda *args: kernel(*args, call), tuple(map(sharding_of, result_shapes)),
            tuple(map(sharding_of, arg_shapes)))

  run.def_partition(partition, sharding_rule=_sharding_rule(operands, results))
  return run


def _on_flat_arrays(kernel, masks_at: int):
  """``kernel(*arrays, masks, *more, call)`` taking its MaskOperands as
  ``MASK_ARRAYS`` arrays from position ``masks_at``: custom_partitioning and
  custom_vmap take flat operand lists."""

  def run(*args):
    *arrays, call = args
    masks = MaskOperands(*arrays[masks_at:masks_at + MASK_ARRAYS])
    return kernel(*arrays[:masks_at], masks, *arrays[masks_at + MASK_ARRAYS:], call)

  return run


_forward = _partitioned(
    _on_flat_arrays(kernels.forward, 3), "forward",
    "B t (k g) h, B s k h, B s k d, B, B, B i, B j, B m, B n, B (k g) u",
    "B t (k g) d, B (k g) t")
_backward = _partitioned(
    _on_flat_arrays(kernels.backward, 6), "backward",
    "B t (k g) h, B s k h, B s k d, B t (k g) d, B (k g) t, B (k g) t, B, B, B i, B j, B m, B n",
    "B t (k g) h, B s k h, B s k d")


def _explicit_specs(q, k, v):
  """For inputs sharded over ``Explicit`` mesh axes (``jax.make_mesh``'s
  default): (mesh, q-like spec function), else None. Such inputs carry their
  sharding in their type, so the kernel runs under ``shard_map`` and its
  outputs get the matching sharded types."""
  mesh = jax.typeof(q).sharding.mesh
  explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == AxisType.Explicit}
  specs = [_spec(jax.typeof(x).sharding, x.ndim) for x in (q, k, v)]
  used = {a for spec in specs for entry in spec for a in axes_of(entry)}
  if not used & explicit:
    return None
  return mesh, _plan(specs, dict(mesh.shape), k.shape[-2], "attention")


def _sharded(fn, cotangents: bool):
  """``fn(*arrays, call)`` made vmappable and usable on explicitly sharded
  arrays and inside ``shard_map``.

  ``custom_partitioning`` has no batching rule, but the kernels take any
  number of leading batch dims, so a vmapped call moves the mapped axis to
  the front of every array. ``cotangents``: the first three outputs are the
  gradients of the first three inputs and take their shardings.
  """

  @functools.cache
  def for_call(call):
    @jax.custom_batching.custom_vmap
    def run(*args):
      return fn(*args, call)

    @run.def_vmap
    def rule(axis_size, in_batched, *args):
      args = [x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
              for x, batched in zip(args, in_batched)]
      outputs = run(*args)
      return outputs, jax.tree.map(lambda _: True, outputs)

    return run

  def apply(*args):
    *operands, call = args
    arrays = jax.tree.leaves(operands)  # MaskOperands' arrays in field order
    explicit = _explicit_specs(*arrays[:3])
    if explicit is None:
      return match_varying(for_call(call)(*arrays), arrays)
    mesh, spec_of = explicit
    # Only the outputs' ranks matter here: shapes without the shardings.
    out_shapes = jax.eval_shape(for_call(call),
                                *(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays))
    kernel = jax.shard_map(lambda *a: match_varying(for_call(call)(*a), a), mesh=mesh,
                           in_specs=tuple(map(spec_of, arrays)),
                           out_specs=tuple(map(spec_of, out_shapes)))
    # NamedShardings, not bare specs: a spec needs a mesh context
    # (jax.set_mesh), which a jit over explicitly sharded arrays may lack.
    outputs = kernel(*(jax.sharding.reshard(x, NamedSharding(mesh, spec_of(x))) for x in arrays))
    if cotangents:
      outputs = tuple(jax.sharding.reshard(g, jax.typeof(x).sharding)
                      for g, x in zip(outputs, arrays))
    return outputs

  return apply


# forward(q, k, v, masks, sinks, call) and backward(q, k, v, dout, lse,
# delta, masks, call): _kernels' on sharded arrays.
forward = _sharded(_forward, cotangents=False)
backward = _sharded(_backward, cotangents=True)


# Paged attention (paged.py) and MLA decoding (mla.py). Their kernel calls
# take (rows [B, T, H, D], the pools, page_table [B, N], q_lens [B], kv_lens
# [B]) and return out [B * splits, T, H, Dv] and lse [B * splits, H, T] (the
# GPU kernels' per-split partials; one split on the CPU). Sequences shard with
# their table rows. Paged attention's pools are k_pages [P, S, Hkv, D] and
# v_pages [P, S, Hkv, Dv], whose heads shard with their query heads (an FP8
# cache's, ``fp8_scales``: then also k_scales and v_scales [P, Hkv, S]); MLA's
# (``pool_ranks`` given: one cache array or the FP8 cache's three) hold one
# row per token for every head and are replicated. The pools are never cut by
# pages, so each device reads the pages of its own heads, with no
# communication.

def _paged_specs(rows_spec, axis_sizes, heads_kv: int, pool_ranks=None, fp8_scales=False):
  """(spec of each operand, spec of each result) for rows sharded as
  ``rows_spec``, or NotImplementedError; ``pool_ranks``: the ranks of
  replicated pools (MLA), else paged attention's k_pages and v_pages (and
  with ``fp8_scales`` their scales)."""
  name = "paged attention" if pool_ranks is None else "mla_decode"
  if rows_spec[1] is not None or rows_spec[3] is not None:
    raise NotImplementedError(
        f"{name}: shard q over batch and/or heads only, got {P(*rows_spec)}")
  batch, heads = rows_spec[0], rows_spec[2]
  shards = int(np.prod([axis_sizes[a] for a in axes_of(heads)]))
  if pool_ranks is not None:
    pools = tuple(P(*(None,) * rank) for rank in pool_ranks)
  elif heads_kv % shards:
    raise NotImplementedError(
        f"paged attention: the heads are sharded {shards} ways ({heads!r}), which splits GQA "
        f"groups of heads_kv={heads_kv} kv heads; shard heads over a divisor of heads_kv")
  else:
    pools = (P(None, None, heads, None),) * 2 + (P(None, heads, None),) * (2 if fp8_scales else 0)
  operands = (P(batch, None, heads, None), *pools, P(batch, None), P(batch), P(batch))
  return operands, (P(batch, None, heads, None), P(batch, heads, None))


def _paged_rule(rows, pools, splits: int, pool_ranks, fp8_scales=False):
  """The Shardy rule of a paged kernel call (see paged_partitioned) for rows
  and the first pool of these types: the heads factor and its sizes."""
  lead = "(b x)" if splits > 1 else "b"
  sizes = {"x": splits} if splits > 1 else {}
  if pool_ranks is None:
    group = rows.shape[2] // pools.shape[2]
    heads = "(k g)" if group > 1 else "k"
    pool_factors = "p s k d, p s k e" + (", p k s, p k s" if fp8_scales else "")
    sizes.update({"g": group} if group > 1 else {})
  else:  # replicated pools: their columns are factors of their own
    heads = "h"
    pool_factors = ", ".join(" ".join(["p", "s", f"c{i}"][:rank])
                             for i, rank in enumerate(pool_ranks))
  spec = (f"b t {heads} d, {pool_factors}, b n, b, b -> {lead} t {heads} e, "
          f"{lead} {heads} t")
  return spec, sizes


def paged_partitioned(kernel, splits: int, pool_ranks=None, fp8_scales=False):
  """``kernel(rows, *pools, page_table, q_lens, kv_lens)`` made to run per
  shard under ``jit`` with Auto mesh axes (``custom_partitioning``) and, as
  it is, inside ``shard_map``; ``pool_ranks``, ``fp8_scales``: see
  _paged_specs."""

  @custom_partitioning
  def run(*args):
    return kernel(*args)

  def partition(mesh, arg_shapes, result_shapes):
    operands, results = _paged_specs(_spec(arg_shapes[0].sharding, 4), dict(mesh.shape),
                                     arg_shapes[1].shape[2] if pool_ranks is None else 1,
                                     pool_ranks, fp8_scales)
    named = lambda specs: tuple(NamedSharding(mesh, s) for s in specs)
    return mesh, kernel, named(results), named(operands)

  def rule(mesh, value_types, result_types):
    del mesh, result_types
    rows, pools = (mlir.ir.RankedTensorType(t) for t in value_types[:2])
    return _paged_rule(rows, pools, splits, pool_ranks, fp8_scales)

  run.def_partition(partition, sharding_rule=rule)
  return lambda *args: match_varying(run(*args), args)


def on_explicit_mesh(attend, q, pools, page_table, cache_lengths, query_lengths,
                     replicated_pools: bool = False, fp8_scales: bool = False):
  """``attend(q, *pools, page_table, cache_lengths, query_lengths)`` ->
  (out, lse); on arrays sharded over Explicit mesh axes it runs under
  ``shard_map`` on each device's shard (the sharding is in the arrays' types,
  which the whole computation must then respect), elsewhere as it is.
  ``pools``: paged attention's (k_pages, v_pages), with ``fp8_scales`` an
  FP8 cache's (k codes, v codes, k scales, v scales), or with
  ``replicated_pools`` MLA's cache arrays."""
  args = (q, *pools, page_table, query_lengths, cache_lengths)
  mesh = jax.typeof(q).sharding.mesh
  explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
              if kind == AxisType.Explicit}
  q_spec = _spec(jax.typeof(q).sharding, 4)
  if not {a for entry in q_spec for a in axes_of(entry)} & explicit:
    return attend(q, *pools, page_table, cache_lengths, query_lengths)
  operands, results = _paged_specs(
      q_spec, dict(mesh.shape), 1 if replicated_pools else pools[0].shape[2],
      tuple(jnp.ndim(p) for p in pools) if replicated_pools else None, fp8_scales)

  def local(*arrays):
    *head, table, q_lens, kv_lens = arrays
    return match_varying(attend(*head, table, kv_lens, q_lens), arrays)

  sharded = jax.shard_map(local, mesh=mesh, in_specs=operands, out_specs=results)
  return sharded(*(jax.sharding.reshard(x, NamedSharding(mesh, s))
                   for x, s in zip(args, operands)))
