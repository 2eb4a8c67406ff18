"""Sharded attention on real GPUs: every visible GPU (2, 4 or 8), the GPU
kernels, bfloat16.

The same properties as test_sharding.py checks on fake CPU devices, now with
real devices and transfers: batch (data parallel) and heads (tensor
parallel) sharding under jit run the kernel per shard without communicating
and give the single-GPU numbers; ring attention over all GPUs matches the
float64 reference; MLA decode and the paged call split their heads over the
GPUs (tensor-parallel serving) without communicating. Run by scripts/gpu_multi.sh; skipped without two GPUs.
"""

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
from test_sharding import COLLECTIVES, assert_matches_reference, assert_sharded, forward_backward

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                       reason="needs at least 2 GPUs"),
]

DTYPE = jnp.bfloat16


def gpu_mesh(name: str):
  """A one-axis mesh over every visible GPU."""
  return jax.sharding.Mesh(np.array(jax.devices()), (name,))


@pytest.mark.parametrize("parallelism", ["data", "tensor"])
def test_batch_and_head_sharding(parallelism):
  mesh = gpu_mesh("x")
  n = mesh.shape["x"]
  # Batch and kv heads are multiples of the GPU count; GQA groups of 2.
  spec = P("x") if parallelism == "data" else P(None, None, "x")
  seq = 1024
  q, k, v, dout = numerics.random_qkv(0, 2 * n, seq, seq, 2 * n, n, 128, DTYPE)
  run = forward_backward(lambda q, k, v: jax_flash.attention(
      q, k, v, causal=True, return_lse=True, implementation="gpu"))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  sharded = [put(x) for x in (q, k, v, dout)]
  got = run(*sharded)
  out, lse, dq, dk, dv = got
  for x in (out, dq, dk, dv):
    assert_sharded(x, mesh, spec)
  assert_sharded(lse, mesh, P(spec[0], *spec[2:]))
  hlo = run.lower(*sharded).compile().as_text()
  assert not [c for c in COLLECTIVES if c in hlo], "batch / heads sharding must not communicate"
  assert_matches_reference(got, q, k, v, dout, **mask_kwargs(seq, seq, causal=True))
  # Each GPU runs the forward kernel on its slice: the numbers of one call on
  # one GPU. The gradients also depend on delta = rowsum(dout * out), which
  # XLA computes with whatever reduction it picks for the shard's shape (one
  # run on 4 H200s differed from one GPU in 108 of 4M dK entries by one bf16
  # ulp), and dQ is summed with atomics: those agree within rounding.
  one_gpu = run(*(jax.device_put(x, jax.devices()[0]) for x in (q, k, v, dout)))
  for name, g, want in zip(("out", "lse"), (out, lse), one_gpu[:2]):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(want), err_msg=name)
  for name, g, want in zip(("dq", "dk", "dv"), (dq, dk, dv), one_gpu[2:]):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=2e-2, err_msg=name)


# Causal ring attention over all GPUs, GQA groups of 4; "docs": 6 packed
# documents per row and 9 padding tokens, as segment ids.
RING_CASES = {
    "contiguous_docs_hd64": dict(layout="contiguous", head_dim=64, docs=True),
    "zigzag_docs_hd128": dict(layout="zigzag", head_dim=128, docs=True),
    "zigzag_hd128": dict(layout="zigzag", head_dim=128, docs=False),
}


@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_attention(case):
  layout, head_dim, docs = (RING_CASES[case][key] for key in ("layout", "head_dim", "docs"))
  mesh = gpu_mesh("sp")
  n = mesh.shape["sp"]
  seq = 512 * n  # 1024 to 4096 tokens: 256 per zigzag chunk
  q, k, v, dout = numerics.random_qkv(1, 2, seq, seq, 8, 2, head_dim, DTYPE)
  ids = packed_segment_ids(2, 2, seq, num_docs=6, padding=9) if docs else None
  zigzag = layout == "zigzag"
  order = (lambda x: jax_flash.to_zigzag(x, n)) if zigzag else (lambda x: x)
  unorder = (lambda x, axis=1: jax_flash.from_zigzag(x, n, axis)) if zigzag else (
      lambda x, axis=1: x)
  run = forward_backward(lambda q, k, v: jax_flash.ring_attention_sharded(
      q, k, v, mesh=mesh, seq_axis="sp", causal=True, layout=layout,
      segment_ids=None if ids is None else order(ids), return_lse=True, implementation="gpu"))
  out, lse, dq, dk, dv = run(*map(order, (q, k, v, dout)))
  assert_sharded(out, mesh, P(None, "sp"))
  got = (unorder(out), unorder(lse, axis=2), *map(unorder, (dq, dk, dv)))
  assert_matches_reference(got, q, k, v, dout,
                           **mask_kwargs(seq, seq, causal=True, segment_ids=ids))


def test_deterministic_ring_repeats_bitwise():
  """With deterministic=True every kernel call adds dQ in a fixed order and
  the ring sums blocks in a fixed order: ten runs, one result."""
  mesh = gpu_mesh("sp")
  n = mesh.shape["sp"]
  seq = 512 * n
  q, k, v, dout = (jax_flash.to_zigzag(x, n) for x in
                   numerics.random_qkv(3, 2, seq, seq, 8, 2, 128, DTYPE))
  run = forward_backward(lambda q, k, v: jax_flash.ring_attention_sharded(
      q, k, v, mesh=mesh, seq_axis="sp", causal=True, layout="zigzag", deterministic=True,
      return_lse=True, implementation="gpu"))
  first = run(q, k, v, dout)
  for _ in range(9):
    chex.assert_trees_all_equal(first, run(q, k, v, dout))


def _replicated_but(mesh, inputs, sharded: dict):
  """inputs placed on the mesh: the names in `sharded` with their spec (a
  pytree of specs for a pytree such as Fp8Pages), the rest replicated."""
  return {name: jax.device_put(x, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                               sharded.get(name, P())))
          for name, x in inputs.items()}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_mla_heads_over_gpus(fp8):
  """MLA decode with its 128 query heads split over every GPU under plain
  jit (tensor parallel; the latent cache replicated): no collective, and
  each GPU's heads get the bits of a one-GPU call on those heads alone."""
  from test_mla import make_batch, run
  mesh = gpu_mesh("tp")
  n = mesh.shape["tp"]
  inputs, _ = make_batch(14, [300, 17], [2, 1], heads=128, fp8=fp8)
  heads = P(None, None, "tp")
  out, lse = run(_replicated_but(mesh, inputs, {"q": heads}), implementation="flash")
  per = 128 // n
  for shard in range(n):
    own = slice(per * shard, per * (shard + 1))
    want_out, want_lse = run(dict(inputs, q=inputs["q"][:, :, own]), implementation="flash")
    np.testing.assert_array_equal(out[:, :, own], want_out)
    np.testing.assert_array_equal(lse[:, own], want_lse)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_paged_kv_heads_over_gpus(fp8):
  """The paged call with its heads and its pool's kv heads (an FP8 pool's
  scales with them) split over every GPU under plain jit (tensor-parallel
  serving): no collective, and the float64 reference's numbers within the
  kernel's tolerance (an FP8 cache: bitwise the unsharded call's)."""
  from test_paged import assert_matches_float64, make_batch
  mesh = gpu_mesh("tp")
  n = mesh.shape["tp"]
  inputs, keys, values = make_batch(11, [300, 17], [1, 5], page_size=64, heads_q=4 * n,
                                    heads_kv=n, head_dim=128, dtype=DTYPE)
  heads = pool = P(None, None, "tp")
  if fp8:
    for name in ("k_pages", "v_pages"):
      inputs[name] = jax_flash.Fp8Pages.quantize(inputs[name])
    pool = jax_flash.Fp8Pages(heads, P(None, "tp"))
  placed = _replicated_but(mesh, inputs, {"q": heads, "k_pages": pool, "v_pages": pool})
  attend = jax.jit(lambda inputs: jax_flash.paged_attention(
      **inputs, return_lse=True, implementation="flash"))
  out, lse = attend(placed)
  assert_sharded(out, mesh, heads)
  hlo = attend.lower(placed).compile().as_text()
  assert not [c for c in COLLECTIVES if c in hlo], "heads sharding must not communicate"
  if fp8:
    want_out, want_lse = attend(inputs)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    return
  got = [np.asarray(x.astype(jnp.float32), np.float64) for x in (out, lse)]
  assert_matches_float64(got, inputs, keys, values, DTYPE, f"over {n} GPUs")
