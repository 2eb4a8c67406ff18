"""Attention sinks on 8 fake CPU devices (conftest.py): ring attention (the
sink joins once, after the ring has merged the blocks, and its gradient sums
over the rows of every sequence shard), and batch / head sharding under jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash
import numerics
from attention_base import mask_kwargs
from attention_sinks import assert_matches_sink_reference, random_cotangents, sink_values

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices")

CASES = {
    # layout, mask, mesh axes (the ring runs over "sp"), where the heads go
    "zigzag-causal": dict(layout="zigzag", causal=True, window=None, names=("dp", "sp"),
                          batch_axis="dp", head_axis=None),
    "contiguous-window": dict(layout="contiguous", causal=False, window=(9, 30),
                              names=("dp", "sp"), batch_axis="dp", head_axis=None),
    "heads-sharded": dict(layout="contiguous", causal=True, window=None, names=("tp", "sp"),
                          batch_axis=None, head_axis="tp"),
}


@pytest.mark.parametrize("case", ["zigzag-causal", *(
    pytest.param(case, marks=pytest.mark.slow) for case in ("contiguous-window",
                                                            "heads-sharded"))])
def test_ring_attention_with_sinks(case):
  layout, causal, window, names, batch_axis, head_axis = (CASES[case][key] for key in (
      "layout", "causal", "window", "names", "batch_axis", "head_axis"))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), names)
  seq, heads_q, heads_kv = 96, 4, 2
  q, k, v, dout = numerics.random_qkv(8, 2, seq, seq, heads_q, heads_kv, 32, jnp.bfloat16)
  dout, dlse = random_cotangents(8, dout.shape, (2, heads_q, seq), jnp.bfloat16)
  sinks = sink_values(heads_q, 8)
  zigzag = layout == "zigzag"
  order = (lambda x, axis=1: jax_flash.to_zigzag(x, 4, axis)) if zigzag else (lambda x, axis=1: x)
  unorder = ((lambda x, axis=1: jax_flash.from_zigzag(x, 4, axis)) if zigzag
             else (lambda x, axis=1: x))

  def attend(q, k, v, sinks):
    return jax_flash.ring_attention_sharded(
        q, k, v, mesh=mesh, seq_axis="sp", batch_axis=batch_axis, head_axis=head_axis,
        causal=causal, window=window, sinks=sinks, layout=layout, return_lse=True,
        implementation="cpu")

  @jax.jit
  def forward_backward(q, k, v, sinks, dout, dlse):
    (out, lse), pullback = jax.vjp(attend, q, k, v, sinks)
    return (out, lse, *pullback((dout, dlse)))

  out, lse, dq, dk, dv, dsinks = forward_backward(*map(order, (q, k, v)), sinks, order(dout),
                                                  order(dlse, 2))
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(batch_axis, "sp", head_axis)), 4)
  got = [unorder(out), unorder(lse, 2), unorder(dq), unorder(dk), unorder(dv), dsinks]
  got = [np.asarray(jnp.asarray(x, jnp.float32)) for x in got]
  assert_matches_sink_reference(got, q, k, v, sinks, dout, dlse, scale=32 ** -0.5,
                                **mask_kwargs(seq, seq, causal, window))


def test_ring_attention_sharded_checks_the_global_sinks():
  # Checked before the shard_map, against every query head (inside it a
  # device holds half of them here).
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("tp", "sp"))
  q, k = jnp.zeros((1, 16, 4, 8), jnp.float32), jnp.zeros((1, 16, 2, 8), jnp.float32)
  with pytest.raises(ValueError, match=r"sinks must have shape \(4,\) \[heads_q\], got \(2,\)"):
    jax_flash.ring_attention_sharded(q, k, k, mesh=mesh, seq_axis="sp", head_axis="tp",
                                     sinks=jnp.zeros(2, jnp.float32), implementation="cpu")


def test_batch_and_head_sharding_with_sinks():
  # The sinks sharded like the heads: the unsharded gradients, nothing
  # gathered (d_sinks sums over the batch shards: one small all-reduce).
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
  q, k, v, dout = numerics.random_qkv(1, 2, 64, 64, 8, 4, 32, jnp.bfloat16)
  spec = P("dp", None, "tp")

  def loss(q, k, v, sinks):
    out, lse = jax_flash.attention(q, k, v, causal=True, sinks=sinks, return_lse=True,
                                   implementation="cpu")
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)) + jnp.sum(jnp.sin(lse))

  grads = jax.jit(jax.grad(loss, (0, 1, 2, 3)))
  put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  sharded_args = (put(q, spec), put(k, spec), put(v, spec), put(sink_values(8, 1), P("tp")))
  sharded = grads(*sharded_args)
  plain = grads(q, k, v, sink_values(8, 1))
  for got, want, want_spec in zip(sharded, plain, (spec, spec, spec, P("tp"))):
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, want_spec), got.ndim)
    # Within one bfloat16 ulp: XLA fuses the per-row work around the kernels
    # (the sinks, cos(lse), delta) differently per shard, which flipped the
    # rounding of 2 of dk's 16k elements.
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2.0 ** -7, atol=1e-5)
  compiled = grads.lower(*sharded_args).compile().as_text()
  assert "all-gather" not in compiled and "all-to-all" not in compiled
