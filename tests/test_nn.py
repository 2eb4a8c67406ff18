"""jax_flash.nn against the stock Flax (linen, NNX) and Equinox layers: same
parameters, same outputs and gradients, under jit."""

import functools

import chex
import equinox as eqx
import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_flash.nn
from jax_flash import _reference as reference

FEATURES = 32
HEADS = 4
TOLERANCE = dict(atol=2e-5, rtol=2e-5)
KERNEL_TARGET = "jax_flash_cpu_fwd_v2"


def uses_kernels(fn, *args) -> bool:
  """Whether ``fn`` lowers to jax_flash's CPU kernel (not an XLA fallback)."""
  return KERNEL_TARGET in jax.jit(fn).lower(*args).as_text()


def inputs(*shape, seed=1):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# Flax linen


@pytest.mark.parametrize("causal", [pytest.param(False, id="full", marks=pytest.mark.slow),
                                    pytest.param(True, id="causal")])
def test_linen_matches_stock(causal):
  x = inputs(2, 3, 19, FEATURES)  # two batch dims: the attention_fn folds them
  stock = linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES)
  ours = linen.MultiHeadDotProductAttention(
      num_heads=HEADS, qkv_features=FEATURES,
      attention_fn=jax_flash.nn.make_flax_attention_fn(is_causal=causal))
  params = stock.init(jax.random.key(0), x)
  mask = linen.make_causal_mask(x[..., 0]) if causal else None

  def loss(layer, mask):
    return lambda params, x: jnp.sum(jnp.sin(layer.apply(params, x, mask=mask)))

  want = jax.jit(jax.value_and_grad(loss(stock, mask), argnums=(0, 1)))(params, x)
  got = jax.jit(jax.value_and_grad(loss(ours, None), argnums=(0, 1)))(params, x)
  chex.assert_trees_all_close(got, want, **TOLERANCE)
  assert uses_kernels(loss(ours, None), params, x)


def test_linen_explicit_mask_falls_back_to_xla():
  x = inputs(2, 13, FEATURES)
  lengths = jnp.array([13, 6])
  keep = jnp.arange(13)[None, :] < lengths[:, None]
  mask = linen.make_attention_mask(jnp.ones((2, 13), bool), keep)
  stock = linen.MultiHeadDotProductAttention(num_heads=HEADS)
  ours = linen.MultiHeadDotProductAttention(num_heads=HEADS,
                                            attention_fn=jax_flash.nn.flax_attention_fn)
  params = stock.init(jax.random.key(0), x)
  chex.assert_trees_all_close(jax.jit(ours.apply)(params, x, mask=mask),
                              jax.jit(stock.apply)(params, x, mask=mask), **TOLERANCE)


def test_linen_flash_only_rejects_mask():
  x = inputs(1, 5, FEATURES)
  layer = linen.MultiHeadDotProductAttention(
      num_heads=HEADS, attention_fn=jax_flash.nn.make_flax_attention_fn(implementation="flash"))
  params = layer.init(jax.random.key(0), x)
  with pytest.raises(NotImplementedError, match="mask"):
    layer.apply(params, x, mask=jnp.ones((1, 1, 5, 5), bool))


# Flax NNX


def nnx_pair(num_kv_heads=None, dropout_rate=0.0):
  kwargs = dict(num_kv_heads=num_kv_heads, dropout_rate=dropout_rate, decode=False)
  stock = nnx.MultiHeadAttention(HEADS, FEATURES, rngs=nnx.Rngs(0), **kwargs)
  ours = nnx.MultiHeadAttention(HEADS, FEATURES, rngs=nnx.Rngs(0),
                                attention_fn=jax_flash.nn.flax_attention_fn, **kwargs)
  return stock, ours


# The quick suite takes GQA causal; the other head groupings and masks are slow.
@pytest.mark.parametrize("num_kv_heads", [pytest.param(None, id="mha", marks=pytest.mark.slow),
                                          pytest.param(2, id="gqa"),
                                          pytest.param(1, id="mqa", marks=pytest.mark.slow)])
@pytest.mark.parametrize("causal", [pytest.param(False, id="full", marks=pytest.mark.slow),
                                    pytest.param(True, id="causal")])
def test_nnx_matches_stock(causal, num_kv_heads):
  stock, ours = nnx_pair(num_kv_heads)
  x = inputs(2, 21, FEATURES)

  def loss_and_grads(layer):
    graphdef, state = nnx.split(layer)

    def loss(state, x):
      return jnp.sum(jnp.sin(nnx.merge(graphdef, state)(x, is_causal=causal)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x), loss, state

  want, _, stock_state = loss_and_grads(stock)
  got, loss, state = loss_and_grads(ours)
  chex.assert_trees_all_equal(state, stock_state)  # same Rngs seed, same parameters
  chex.assert_trees_all_close(got, want, **TOLERANCE)
  assert uses_kernels(loss, state, x)


def test_nnx_dropout():
  stock, ours = nnx_pair(dropout_rate=0.1)
  x = inputs(2, 9, FEATURES)
  with pytest.raises(NotImplementedError, match="dropout"):
    ours(x, deterministic=False)
  # Without dropout in force (evaluation), the layer is the stock one.
  chex.assert_trees_all_close(ours(x, deterministic=True), stock(x, deterministic=True),
                              **TOLERANCE)


def test_nnx_sow_weights_is_rejected():
  _, ours = nnx_pair()
  with pytest.raises(NotImplementedError, match="sow_weights"):
    ours(inputs(1, 4, FEATURES), sow_weights=True)


# Equinox


EQX_CASES = {
    "self": dict(sizes={}, seq_q=23, seq_k=23),
    "cross-sizes": dict(sizes=dict(key_size=24, value_size=20, output_size=12, qk_size=16,
                                   vo_size=8, use_query_bias=True, use_value_bias=True,
                                   use_output_bias=True), seq_q=11, seq_k=30),
}


def eqx_pair(causal=False, **sizes):
  key = jax.random.key(7)
  stock = eqx.nn.MultiheadAttention(HEADS, FEATURES, key=key, **sizes)
  ours = jax_flash.nn.MultiheadAttention(HEADS, FEATURES, key=key, causal=causal, **sizes)
  return stock, ours


def params(layer):
  """The parameters of an Equinox layer, keyed by field path (the two
  classes' pytree nodes differ only in static fields)."""
  leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(layer, eqx.is_array))
  return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def eqx_inputs(stock, seq_q, seq_k, batch=2):
  return (inputs(batch, seq_q, stock.query_size, seed=1),
          inputs(batch, seq_k, stock.key_size, seed=2),
          inputs(batch, seq_k, stock.value_size, seed=3))


def eqx_loss(layer, mask=None, **kwargs):
  def loss(layer, q, k, v):
    out = jax.vmap(lambda q, k, v: layer(q, k, v, mask, **kwargs))(q, k, v)
    return jnp.sum(jnp.sin(out))

  return lambda q, k, v: eqx.filter_jit(eqx.filter_value_and_grad(loss))(layer, q, k, v)


def assert_same_loss_and_grads(got, want):
  (got_loss, got_grads), (want_loss, want_grads) = got, want
  chex.assert_trees_all_close(got_loss, want_loss, **TOLERANCE)
  chex.assert_trees_all_close(params(got_grads), params(want_grads), **TOLERANCE)


@pytest.mark.parametrize("case", [pytest.param("self", marks=pytest.mark.slow), "cross-sizes"])
@pytest.mark.parametrize("causal", [pytest.param(False, id="full", marks=pytest.mark.slow),
                                    pytest.param(True, id="causal")])
def test_equinox_matches_stock(causal, case):
  sizes, seq_q, seq_k = (EQX_CASES[case][name] for name in ("sizes", "seq_q", "seq_k"))
  stock, ours = eqx_pair(causal, **sizes)
  # Same key, same parameters: the layers are interchangeable.
  chex.assert_trees_all_equal(params(ours), params(stock))
  q, k, v = eqx_inputs(stock, seq_q, seq_k)
  # The stock layer gets causality as a mask, aligned bottom-right like ours.
  mask = (jnp.arange(seq_k)[None, :] <= jnp.arange(seq_q)[:, None] + seq_k - seq_q
          if causal else None)
  got = eqx_loss(ours)(q, k, v)
  want = eqx_loss(stock, mask)(q, k, v)
  assert_same_loss_and_grads(got, want)
  assert uses_kernels(lambda q, k, v: jax.vmap(ours)(q, k, v), q, k, v)


def test_equinox_explicit_mask():
  stock, ours = eqx_pair()
  q, k, v = eqx_inputs(stock, 10, 10)
  mask = jax.random.bernoulli(jax.random.key(4), 0.7, (HEADS, 10, 10)) | jnp.eye(10, dtype=bool)
  got = eqx_loss(ours, mask)(q, k, v)
  want = eqx_loss(stock, mask)(q, k, v)
  assert_same_loss_and_grads(got, want)


def test_equinox_process_heads():
  stock, ours = eqx_pair()
  q, k, v = eqx_inputs(stock, 12, 12)

  def process_heads(q, k, v):  # a stand-in for rotary embeddings
    position = jnp.arange(q.shape[0], dtype=q.dtype)[:, None, None]
    return q * jnp.cos(position), k * jnp.cos(position), v

  got = eqx_loss(ours, process_heads=process_heads)(q, k, v)
  want = eqx_loss(stock, process_heads=process_heads)(q, k, v)
  assert_same_loss_and_grads(got, want)
  with pytest.raises(ValueError, match="process_heads"):
    ours(q[0], k[0], v[0], process_heads=lambda q, k, v: (q[:1], k, v))


def test_equinox_dropout():
  stock, ours = eqx_pair(dropout_p=0.1)
  q, k, v = (x[0] for x in eqx_inputs(stock, 6, 6))
  with pytest.raises(NotImplementedError, match="dropout"):
    ours(q, k, v, key=jax.random.key(0))
  chex.assert_trees_all_close(ours(q, k, v, inference=True), stock(q, k, v, inference=True),
                              **TOLERANCE)
  chex.assert_trees_all_close(eqx.nn.inference_mode(ours)(q, k, v),
                              eqx.nn.inference_mode(stock)(q, k, v), **TOLERANCE)


# Attention sinks (issue 52)


SINKS = jnp.linspace(-1.0, 3.0, HEADS, dtype=jnp.float32)


class LinenSinkBlock(linen.Module):
  """A stock linen attention layer whose attention_fn gets this module's
  sinks parameter (nn.py's module docstring)."""
  attention_fn: object  # sinks -> attention_fn

  @linen.compact
  def __call__(self, x):
    sinks = self.param("sinks", lambda key: SINKS)
    return linen.MultiHeadDotProductAttention(
        num_heads=HEADS, qkv_features=FEATURES, attention_fn=self.attention_fn(sinks))(x)


def reference_attention_fn(causal):
  """An attention_fn with sinks in plain XLA: the softmax with a sink column."""
  def with_sinks(sinks):
    def attend(query, key, value):
      out, _ = reference.attention_reference(query, key, value, scale=query.shape[-1] ** -0.5,
                                             window_right=0 if causal else -1, sinks=sinks)
      return out
    return attend
  return with_sinks


@pytest.mark.parametrize("causal", [pytest.param(False, id="full", marks=pytest.mark.slow),
                                    pytest.param(True, id="causal")])
def test_linen_sinks_from_a_parent_module(causal):
  x = inputs(2, 19, FEATURES)
  ours = LinenSinkBlock(lambda sinks: functools.partial(
      jax_flash.nn.make_flax_attention_fn(is_causal=causal), sinks=sinks))
  plain = LinenSinkBlock(reference_attention_fn(causal))
  params = ours.init(jax.random.key(0), x)

  def loss(layer):
    return lambda params, x: jnp.sum(jnp.sin(layer.apply(params, x)))

  got = jax.jit(jax.value_and_grad(loss(ours), argnums=(0, 1)))(params, x)
  want = jax.jit(jax.value_and_grad(loss(plain), argnums=(0, 1)))(params, x)
  chex.assert_trees_all_close(got, want, **TOLERANCE)
  assert np.all(np.abs(np.asarray(got[1][0]["params"]["sinks"])) > 1e-3)  # the sinks learn
  assert uses_kernels(loss(ours), params, x)


def test_flax_sinks_need_the_mask_as_structure():
  q = inputs(1, 5, HEADS, 8)
  with pytest.raises(NotImplementedError, match="attention sinks with a mask"):
    jax_flash.nn.flax_attention_fn(q, q, q, mask=jnp.ones((1, 1, 5, 5), bool), sinks=SINKS)
  with pytest.raises(ValueError, match=r"sinks must have shape \(4,\)"):
    jax_flash.nn.flax_attention_fn(q, q, q, sinks=SINKS[:2])


@pytest.mark.slow  # the quick suite's layer sinks: test_linen_sinks_from_a_parent_module
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_equinox_sinks(causal):
  # The kernel path against the layer's own XLA path for masks (an all-true
  # mask), both with the layer's sinks; zero sinks by default, set here.
  stock, _ = eqx_pair(causal)
  ours = jax_flash.nn.MultiheadAttention(HEADS, FEATURES, key=jax.random.key(7), causal=causal,
                                         use_sinks=True)
  chex.assert_trees_all_equal(ours.sinks, jnp.zeros(HEADS, jnp.float32))
  ours = eqx.tree_at(lambda layer: layer.sinks, ours, SINKS)
  q, k, v = eqx_inputs(stock, 17, 17)
  got = eqx_loss(ours)(q, k, v)
  want = eqx_loss(ours, jnp.ones((17, 17), bool))(q, k, v)
  assert_same_loss_and_grads(got, want)
  assert np.all(np.abs(np.asarray(got[1].sinks)) > 1e-3)
  assert uses_kernels(lambda q, k, v: jax.vmap(ours)(q, k, v), q, k, v)
  # Sinks of -inf are none: the stock layer's result.
  no_sinks = eqx.tree_at(lambda layer: layer.sinks, ours, jnp.full(HEADS, -jnp.inf))
  mask = jnp.tril(jnp.ones((17, 17), bool)) if causal else None
  chex.assert_trees_all_close(jax.vmap(no_sinks)(q, k, v),
                              jax.vmap(lambda q, k, v: stock(q, k, v, mask))(q, k, v),
                              **TOLERANCE)
