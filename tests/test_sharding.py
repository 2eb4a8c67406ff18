"""Multi-device attention on 8 fake CPU devices (conftest.py sets XLA_FLAGS):
batch / heads sharding through jit and shard_map, ring attention over a
sharded sequence (with packed documents too), and the errors for shardings
the kernels cannot serve."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
import numerics
from attention_base import mask_kwargs, packed_segment_ids

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

DTYPE = jnp.bfloat16
COLLECTIVES = ("all-gather", "all-reduce", "collective-permute", "all-to-all", "reduce-scatter")


def auto_mesh(shape=(2, 4), names=("dp", "tp")):
  devices = np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape)
  return jax.sharding.Mesh(devices, names)


def forward_backward(fn):
  """jit(q, k, v, dout -> out, lse, dq, dk, dv) for fn(q, k, v) -> (out, lse)."""

  def run(q, k, v, dout):
    (out, lse), pullback = jax.vjp(fn, q, k, v)
    return (out, lse, *pullback((dout, jnp.zeros_like(lse))))

  return jax.jit(run)


def assert_matches_reference(got, q, k, v, dout, **mask):
  """The tolerance principle against the unsharded float64 reference."""
  scale = 1.0 / np.sqrt(q.shape[-1])
  ref = numerics.float64_reference(q, k, v, dout, scale=scale, **mask)
  naive = numerics.naive(q, k, v, dout, scale=scale, **mask)
  for name, g, r, n in zip(("out", "lse", "dq", "dk", "dv"), got, ref, naive):
    g = np.asarray(jnp.asarray(g, jnp.float32))
    numerics.assert_within_tolerance(name, g, r, n, q.dtype, reduction=k.shape[1])


def assert_sharded(x, mesh, spec):
  want = NamedSharding(mesh, spec)
  assert x.sharding.is_equivalent_to(want, x.ndim), f"sharding {x.sharding.spec}, expected {spec}"


# Batch (data parallel) and heads (tensor parallel) sharding under jit.

SPECS = {"data": P("dp"), "tensor": P(None, None, "tp"), "data_tensor": P("dp", None, "tp")}


def quick_first(cases, quick):
  """``cases`` as pytest params, all but the ``quick`` ones marked slow: the
  quick suite keeps a case or two per feature, ``-m slow`` runs the rest."""
  params = []
  for case in cases:
    values = case if isinstance(case, tuple) else (case,)
    marks = () if case in quick else pytest.mark.slow
    params.append(pytest.param(*values, id="-".join(map(str, values)), marks=marks))
  return params


@pytest.mark.parametrize("layout,causal", quick_first(
    [(layout, causal) for layout in SPECS for causal in ("full", "causal")],
    quick=[("data_tensor", "causal")]))
def test_batch_and_head_sharding(layout, causal):
  causal = causal == "causal"
  mesh, spec = auto_mesh(), SPECS[layout]
  q, k, v, dout = numerics.random_qkv(0, 2, 45, 45, 8, 4, 32, DTYPE)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  run = forward_backward(lambda q, k, v: jax_flash.attention(
      q, k, v, causal=causal, return_lse=True, implementation="cpu"))
  got = run(*map(put, (q, k, v, dout)))
  assert_matches_reference(got, q, k, v, dout, **mask_kwargs(45, 45, causal))
  # Per-shard kernel calls on the local slices: the same numbers as one call.
  unsharded = run(q, k, v, dout)
  for g, u in zip(got, unsharded):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(u))
  out, lse, dq, dk, dv = got
  for x in (out, dq, dk, dv):
    assert_sharded(x, mesh, spec)
  assert_sharded(lse, mesh, P(spec[0], *spec[2:]))
  hlo = run.lower(*map(put, (q, k, v, dout))).compile().as_text()
  assert not [c for c in COLLECTIVES if c in hlo], "batch / heads sharding must not communicate"


def test_replicated_kv_follows_q_sharding():
  # k, v replicated: each device slices its heads locally, still no collective.
  mesh = auto_mesh()
  q, k, v, _ = numerics.random_qkv(1, 2, 33, 40, 8, 4, 32, DTYPE)
  f = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cpu"))
  q_sharded = jax.device_put(q, NamedSharding(mesh, P("dp", None, "tp")))
  out = f(q_sharded, k, v)
  assert_sharded(out, mesh, P("dp", None, "tp"))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(f(q, k, v)))
  assert not [c for c in COLLECTIVES if c in f.lower(q_sharded, k, v).compile().as_text()]


@pytest.mark.parametrize("context,implementation", quick_first(
    [(context, implementation) for context in ("set_mesh", "no_mesh_context")
     for implementation in ("default", "cpu")],
    quick=[("no_mesh_context", "default"), ("set_mesh", "cpu")]))
def test_explicit_mesh_sharding(context, implementation):
  implementation = None if implementation == "default" else implementation
  # jax.make_mesh's default Explicit axes carry the sharding in the types,
  # with or without a mesh context (the README's multi-device example).
  mesh = jax.make_mesh((2, 4), ("dp", "tp"))
  q, k, v, dout = numerics.random_qkv(2, 2, 30, 30, 8, 4, 32, DTYPE)
  spec = P("dp", None, "tp", None)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  run = forward_backward(lambda q, k, v: jax_flash.attention(
      q, k, v, causal=True, return_lse=True, implementation=implementation))
  if context == "set_mesh":
    with jax.set_mesh(mesh):
      got = run(*map(put, (q, k, v, dout)))
  else:
    got = run(*map(put, (q, k, v, dout)))
  assert_matches_reference(got, q, k, v, dout, **mask_kwargs(30, 30, True))
  assert_sharded(got[1], mesh, P("dp", "tp"))
  for x in (got[0], *got[2:]):
    assert_sharded(x, mesh, spec)


@pytest.mark.parametrize("implementation", quick_first([None, "cpu", "xla"], quick=["cpu"]))
def test_shard_map_gradients_with_check_vma(implementation):
  mesh = auto_mesh()
  q, k, v, dout = numerics.random_qkv(3, 2, 40, 40, 8, 4, 32, DTYPE)
  spec, lse_spec = P("dp", None, "tp"), P("dp", "tp")
  attend = jax.shard_map(
      lambda q, k, v: jax_flash.attention(q, k, v, causal=True, return_lse=True,
                                          implementation=implementation),
      mesh=mesh, in_specs=(spec, spec, spec), out_specs=(spec, lse_spec))
  got = forward_backward(attend)(q, k, v, dout)
  assert_matches_reference(got, q, k, v, dout, **mask_kwargs(40, 40, True))


# Shardings the per-shard kernel call cannot serve.

@pytest.mark.parametrize("q_spec,heads_kv,match", [
    (P(None, "tp"), 4, "q is sharded along the sequence"),
    (P(None, None, None, "tp"), 4, "q is sharded along the head dim"),
    (P(None, None, "tp"), 2, r"heads are sharded 4 ways .* splits GQA groups of heads_kv=2"),
], ids=["seq", "head_dim", "split_group"])
@pytest.mark.parametrize("mode", quick_first(["auto", "explicit"], quick=["auto"]))
def test_unsupported_sharding_raises(mode, q_spec, heads_kv, match):
  q, k, v, _ = numerics.random_qkv(4, 2, 16, 16, 8, heads_kv, 32, DTYPE)
  f = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, implementation="cpu"))
  if mode == "explicit":
    # The sharding is known while tracing: a plain NotImplementedError.
    mesh = jax.make_mesh((2, 4), ("dp", "tp"))
    with jax.set_mesh(mesh), pytest.raises(NotImplementedError, match=match):
      f(jax.device_put(q, NamedSharding(mesh, q_spec)), k, v)
  else:
    # Auto axes are resolved by the partitioner at compile time, which
    # reports the same message through XLA's runtime error.
    mesh = auto_mesh()
    with pytest.raises(Exception, match=match):
      f(jax.device_put(q, NamedSharding(mesh, q_spec)), k, v)


# Ring attention (context parallel) over "sp", data parallel over "dp".

RING_CASES = {
    "contiguous_full_gqa": dict(layout="contiguous", causal=False, window=None, heads_kv=2),
    "zigzag_causal_gqa": dict(layout="zigzag", causal=True, window=None, heads_kv=2),
    "zigzag_causal_mqa": dict(layout="zigzag", causal=True, window=None, heads_kv=1),
    "contiguous_causal_window": dict(layout="contiguous", causal=True, window=(20, None),
                                     heads_kv=4),
    "zigzag_window": dict(layout="zigzag", causal=False, window=(9, 30), heads_kv=2),
}


def ring_sharded(mesh, layout, segment_ids=None, **kwargs):
  """q, k, v -> (out, lse) of the ring over "sp" (data parallel over "dp")
  for inputs already in ``layout`` order; segment ids are captured, so put
  them in ``layout`` order too."""
  return lambda q, k, v: jax_flash.ring_attention_sharded(
      q, k, v, mesh=mesh, seq_axis="sp", batch_axis="dp", segment_ids=segment_ids,
      layout=layout, return_lse=True, implementation="cpu", **kwargs)


def check_ring(layout, q, k, v, dout, causal=False, window=None, segment_ids=None, **options):
  """Ring attention over sp=4 (dp=2) against the unsharded float64 reference,
  outputs and gradients; inputs in sequence order."""
  mesh, sp = auto_mesh(names=("dp", "sp")), 4
  zigzag = layout == "zigzag"
  order = (lambda x: jax_flash.to_zigzag(x, sp)) if zigzag else (lambda x: x)
  unorder = (lambda x, axis=1: jax_flash.from_zigzag(x, sp, axis)) if zigzag else (
      lambda x, axis=1: x)
  run = forward_backward(ring_sharded(mesh, layout, jax.tree.map(order, segment_ids),
                                      causal=causal, window=window, **options))
  out, lse, dq, dk, dv = run(*map(order, (q, k, v, dout)))
  assert_sharded(out, mesh, P("dp", "sp"))
  assert_sharded(lse, mesh, P("dp", None, "sp"))
  got = (unorder(out), unorder(lse, axis=2), *map(unorder, (dq, dk, dv)))
  mask = mask_kwargs(q.shape[1], k.shape[1], causal, window, segment_ids=segment_ids)
  assert_matches_reference(got, q, k, v, dout, softcap=options.get("softcap") or 0.0, **mask)
  return got


@pytest.mark.parametrize("case", quick_first(
    list(RING_CASES), quick=["zigzag_causal_mqa"]))
def test_ring_attention(case):
  layout, causal, window, heads_kv = (RING_CASES[case][key] for key in
                                      ("layout", "causal", "window", "heads_kv"))
  seq = 96  # 12 positions per zigzag chunk
  q, k, v, dout = numerics.random_qkv(5, 2, seq, seq, 4, heads_kv, 32, DTYPE)
  check_ring(layout, q, k, v, dout, causal, window)


@pytest.mark.parametrize("layout", quick_first(["zigzag", "contiguous"], quick=[]))
def test_ring_softcap_and_deterministic(layout):
  q, k, v, dout = numerics.random_qkv(6, 2, 96, 96, 4, 2, 32, DTYPE)
  first = check_ring(layout, q, k, v, dout, causal=True, softcap=1.5, deterministic=True)
  again = check_ring(layout, q, k, v, dout, causal=True, softcap=1.5, deterministic=True)
  chex.assert_trees_all_equal(first, again)


def interleaved_segment_ids(seed, batch, seq, num_docs):
  """Ids drawn at random per token: documents that are not contiguous, so
  the kernels' bounds span other documents' tokens."""
  ids = np.random.default_rng(seed).integers(0, num_docs, (batch, seq))
  return jnp.asarray(ids, jnp.int32)


# Packed documents through the ring: 5 documents of random lengths that cross
# the block boundaries, and 7 padding tokens (id -1 for q and kv alike); or
# "interleaved", 3 ids drawn per token.
SEGMENT_CASES = {
    "contiguous_full_gqa": dict(layout="contiguous", causal=False, heads_kv=2),
    "contiguous_causal_gqa": dict(layout="contiguous", causal=True, heads_kv=2),
    "zigzag_causal_gqa": dict(layout="zigzag", causal=True, heads_kv=2),
    "zigzag_full_mqa": dict(layout="zigzag", causal=False, heads_kv=1),
    "zigzag_causal_window_interleaved": dict(layout="zigzag", causal=True, window=(30, None),
                                             heads_kv=2, interleaved=True),
}


@pytest.mark.parametrize("case", quick_first(
    list(SEGMENT_CASES), quick=["contiguous_causal_gqa"]))
def test_ring_attention_segment_ids(case):
  config = dict(SEGMENT_CASES[case])
  layout, heads_kv = config.pop("layout"), config.pop("heads_kv")
  seq = 96
  if config.pop("interleaved", False):
    ids = interleaved_segment_ids(14, 2, seq, num_docs=3)
  else:
    ids = packed_segment_ids(14, 2, seq, num_docs=5, padding=7)
  q, k, v, dout = numerics.random_qkv(15, 2, seq, seq, 4, heads_kv, 32, DTYPE)
  check_ring(layout, q, k, v, dout, segment_ids=ids, **config)


@pytest.mark.slow
def test_ring_attention_cross_segment_ids():
  # A (q, kv) pair of different lengths; q's 6 padding tokens (id -1) match no
  # key in any block: zero output, -inf lse, zero dq.
  q_ids = packed_segment_ids(16, 2, 64, num_docs=4, padding=6)
  kv_ids = packed_segment_ids(17, 2, 96, num_docs=4)
  q, k, v, dout = numerics.random_qkv(18, 2, 64, 96, 4, 2, 32, DTYPE)
  out, lse, dq, _, _ = check_ring("contiguous", q, k, v, dout, segment_ids=(q_ids, kv_ids))
  assert np.all(np.asarray(out)[:, -6:] == 0) and np.all(np.asarray(dq)[:, -6:] == 0)
  assert np.all(np.isneginf(np.asarray(lse)[:, :, -6:]))


@pytest.mark.slow
def test_ring_documents_are_independent():
  # Changing every token of one document leaves the outputs and gradients of
  # the other documents bitwise unchanged, through the ring and its merges.
  mesh, sp, seq = auto_mesh(names=("dp", "sp")), 4, 96
  ids = jax_flash.to_zigzag(packed_segment_ids(19, 2, seq, num_docs=4), sp)
  q, k, v, dout = (jax_flash.to_zigzag(x, sp) for x in
                   numerics.random_qkv(20, 2, seq, seq, 4, 2, 32, DTYPE))
  run = forward_backward(ring_sharded(mesh, "zigzag", ids, causal=True))
  changed = ids == 2
  bump = lambda x: jnp.where(changed[:, :, None, None], x * 2 + 1, x)
  first = run(q, k, v, dout)
  second = run(bump(q), bump(k), bump(v), bump(dout))
  keep = ~np.asarray(changed)
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
    a, b = np.asarray(a), np.asarray(b)
    if name == "lse":  # [B, N, T]: move the tokens next to the batch
      a, b = np.swapaxes(a, 1, 2), np.swapaxes(b, 1, 2)
    assert not np.array_equal(a, b), f"{name}: the changed document must change something"
    np.testing.assert_array_equal(a[keep], b[keep], err_msg=name)


def test_ring_attention_lse_cotangent_and_heads_axis():
  # A loss through lse, with heads sharded too: against the unsharded call.
  mesh = auto_mesh((2, 4), ("tp", "sp"))
  q, k, v, _ = numerics.random_qkv(6, 1, 64, 64, 4, 2, 16, jnp.float32)

  def loss(attend):
    def f(q, k, v):
      out, lse = attend(q, k, v)
      return jnp.sum(out ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), jnp.sin(lse), 0.0))
    return jax.jit(jax.value_and_grad(f, (0, 1, 2)))

  ring = loss(lambda q, k, v: jax_flash.ring_attention_sharded(
      q, k, v, mesh=mesh, seq_axis="sp", head_axis="tp", causal=True, layout="contiguous",
      return_lse=True, implementation="cpu"))
  plain = loss(lambda q, k, v: jax_flash.attention(q, k, v, causal=True, return_lse=True,
                                                   implementation="cpu"))
  for got, want in zip(jax.tree.leaves(ring(q, k, v)), jax.tree.leaves(plain(q, k, v))):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_ring_attention_sharded_on_explicit_mesh():
  # Unsharded inputs (segment ids too) on a jax.make_mesh (Explicit) mesh are
  # resharded for the ring.
  mesh = jax.make_mesh((2, 4), ("dp", "sp"))
  q, k, v, _ = numerics.random_qkv(9, 2, 32, 32, 2, 1, 16, jnp.float32)
  ids = packed_segment_ids(9, 2, 32, num_docs=3)
  grads = lambda attend: jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) ** 2),
                                          (0, 1, 2)))(q, k, v)
  ring = grads(lambda q, k, v: jax_flash.ring_attention_sharded(
      q, k, v, mesh=mesh, seq_axis="sp", batch_axis="dp", causal=True, segment_ids=ids,
      implementation="cpu"))
  plain = grads(lambda q, k, v: jax_flash.attention(q, k, v, causal=True, segment_ids=ids,
                                                    implementation="cpu"))
  for got, want in zip(ring, plain):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_ring_hlo_uses_collective_permute_only():
  mesh = auto_mesh((8,), ("sp",))
  q, k, v, _ = numerics.random_qkv(7, 1, 64, 64, 2, 1, 16, DTYPE)
  f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax_flash.ring_attention_sharded(
      q, k, v, mesh=mesh, seq_axis="sp", causal=True, layout="zigzag",
      implementation="cpu").astype(jnp.float32)), (0, 1, 2)))
  hlo = f.lower(q, k, v).compile().as_text()
  assert "collective-permute" in hlo
  assert not [c for c in ("all-gather", "all-to-all") if c in hlo]


def test_zigzag_round_trip():
  x = jnp.arange(2 * 16).reshape(2, 16)
  z = jax_flash.to_zigzag(x, 4)
  np.testing.assert_array_equal(z[0, :4], [0, 1, 14, 15])  # chunks 0 and 7 on device 0
  np.testing.assert_array_equal(jax_flash.from_zigzag(z, 4), x)


@pytest.mark.slow
def test_multi_host_recipe_on_one_host():
  # The README's multi-host program, run by one process over its 8 devices:
  # explicitly sharded arrays in zigzag order, the output compared in order.
  mesh = jax.make_mesh((jax.process_count(), 8), ("dp", "sp"))
  spec = NamedSharding(mesh, P("dp", "sp"))
  q, k, v, _ = numerics.random_qkv(8, 2, 128, 128, 4, 2, 16, jnp.float32)
  local = [np.asarray(jax_flash.to_zigzag(x, 8)) for x in (q, k, v)]
  sharded = [jax.make_array_from_process_local_data(spec, x) for x in local]
  attend = jax.jit(lambda q, k, v: jax_flash.ring_attention_sharded(
      q, k, v, mesh=mesh, seq_axis="sp", batch_axis="dp", causal=True, layout="zigzag",
      implementation="cpu"))
  out = attend(*sharded)
  assert out.sharding.spec == P("dp", "sp", None, None)
  back = jax_flash.from_zigzag(out, 8)
  assert back.sharding.spec == P("dp", "sp", None, None)
  want = jax_flash.attention(q, k, v, causal=True, implementation="xla")
  np.testing.assert_allclose(np.asarray(back), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(layout="spiral"), ValueError, "layout must be one of"),
    (dict(implementation="xla"), NotImplementedError, "implementation='xla' is not supported"),
    (dict(causal=True, seq_k=32), ValueError, "needs q and k/v blocks of one length"),
    (dict(layout="zigzag", seq_q=15, seq_k=15), ValueError, "even local sequence lengths"),
    (dict(head_axis="tp", heads_kv=1), NotImplementedError, "splits GQA groups"),
    (dict(segment_ids=jnp.zeros((1, 63), jnp.int32)), ValueError,
     r"q_segment_ids must have shape \(1, 64\), got \(1, 63\)"),
    (dict(segment_ids=(jnp.zeros((1, 64), jnp.int32), jnp.zeros((2, 64), jnp.int32))),
     ValueError, r"kv_segment_ids must have shape \(1, 64\), got \(2, 64\)"),
    (dict(segment_ids=jnp.zeros((1, 64), jnp.float32)), ValueError,
     "q_segment_ids must have dtype int32, got float32"),
    (dict(segment_ids=jnp.zeros((1, 64), jnp.int32), seq_k=32), ValueError,
     "one segment_ids array needs seq_q == seq_k"),
])
def test_ring_errors(kwargs, error, match):
  mesh = auto_mesh((2, 4), ("tp", "sp"))
  seq_q, seq_k = kwargs.pop("seq_q", 16), kwargs.pop("seq_k", 16)
  q, k, v, _ = numerics.random_qkv(8, 1, 4 * seq_q, 4 * seq_k, 4, kwargs.pop("heads_kv", 4), 16,
                                   DTYPE)
  with pytest.raises(error, match=match):
    jax_flash.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="sp", **kwargs)


def test_ring_outside_shard_map_raises():
  q = jnp.zeros((1, 16, 2, 16), DTYPE)
  with pytest.raises(ValueError, match="mesh axis 'sp' bound: call it inside shard_map"):
    jax_flash.ring_attention(q, q, q, axis_name="sp")


def test_zigzag_indices_error():
  with pytest.raises(ValueError, match="seq_len 30 is not a multiple of 8"):
    jax_flash.to_zigzag(jnp.zeros((1, 30)), 4)


@pytest.mark.parametrize("sequences", ["replicated", "sharded"])
@pytest.mark.parametrize("cache", ["bfloat16", "fp8"])
@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_paged_cache_write_sharded(axes, cache, sequences):
  """write_paged_cache on pools sharded over kv heads (an FP8 pool's scales
  with them) under jit, Auto or Explicit mesh axes: the unsharded pools'
  bits. With the sequences replicated (tensor-parallel serving) no
  collective runs; sharded over the other axis, each replica of the pool
  still takes every sequence's tokens."""
  from jax.sharding import AxisType
  from jax_flash import _paged_fp8 as paged_fp8
  kind = AxisType.Auto if axes == "auto" else AxisType.Explicit
  mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(kind, kind))
  batch, new, heads_kv, dim, num_pages, page_size = 4, 3, 4, 64, 20, 16
  rng = np.random.default_rng(5)
  k, v = (jnp.asarray(rng.normal(size=(batch, new, heads_kv, dim)), DTYPE) for _ in range(2))
  table = jnp.asarray(rng.permutation(num_pages)[:batch * 4].reshape(batch, 4), jnp.int32)
  lengths = jnp.asarray([5, 17, 30, 3], jnp.int32)
  pool_spec = P(None, None, "tp")
  if cache == "fp8":
    pools = (paged_fp8.Fp8Pages.zeros(num_pages, page_size, heads_kv, dim),) * 2
    pool_spec = paged_fp8.Fp8Pages(pool_spec, P(None, "tp"))
  else:
    pools = (jnp.zeros((num_pages, page_size, heads_kv, dim), DTYPE),) * 2
  rows = "dp" if sequences == "sharded" else None
  specs = (pool_spec, pool_spec, P(rows, None, "tp"), P(rows, None, "tp"), P(rows), P(rows))
  args = (*pools, k, v, table, lengths)
  placed = [jax.device_put(x, jax.tree.map(lambda s: NamedSharding(mesh, s), s))
            for x, s in zip(args, specs)]
  write = jax.jit(jax_flash.write_paged_cache)
  for got, want in zip(jax.tree.leaves(write(*placed)), jax.tree.leaves(write(*args))):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  if sequences == "replicated":
    hlo = write.lower(*placed).compile().as_text()
    assert not [c for c in COLLECTIVES if c in hlo], "a tensor-parallel write must not communicate"


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_mla_cache_write_sharded(axes, kv_dtype):
  """write_mla_cache with the sequences sharded and the (replicated) cache
  under jit, Auto or Explicit mesh axes: the unsharded cache's bits."""
  from jax.sharding import AxisType
  kind = AxisType.Auto if axes == "auto" else AxisType.Explicit
  mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(kind, kind))
  rng = np.random.default_rng(6)
  cache = jax_flash.empty_mla_cache(12, jnp.dtype(kv_dtype))
  latent = jnp.asarray(rng.normal(size=(4, 2, 576)), DTYPE)
  table = jnp.asarray(rng.permutation(12)[:8].reshape(4, 2), jnp.int32)
  lengths = jnp.asarray([5, 70, 30, 3], jnp.int32)
  args = (cache, latent, table, lengths)
  placed = [jax.device_put(x, jax.tree.map(lambda _, s=s: NamedSharding(mesh, s), x))
            for x, s in zip(args, (P(), P("dp"), P("dp"), P("dp")))]
  write = jax.jit(jax_flash.write_mla_cache)
  for got, want in zip(jax.tree.leaves(write(*placed)), jax.tree.leaves(write(*args))):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
