"""jax_flash inside Flax (linen and NNX) and Equinox attention layers.

Flax: both ``flax.linen.MultiHeadDotProductAttention`` and
``flax.nnx.MultiHeadAttention`` take an ``attention_fn``; hand them
``flax_attention_fn`` and keep the stock layer, its parameters and its
checkpoints::

  layer = nn.MultiHeadDotProductAttention(num_heads=8,
                                          attention_fn=jax_flash.nn.flax_attention_fn)
  layer = nnx.MultiHeadAttention(8, 512, attention_fn=jax_flash.nn.flax_attention_fn,
                                 rngs=rngs)
  y = layer(x, is_causal=True)  # NNX passes is_causal to the attention_fn

The kernels need the mask as structure (causal, window), not as a boolean
array. Linen's layer has no ``is_causal`` argument, so build the function with
the structure instead of passing ``nn.make_causal_mask``::

  attention_fn=jax_flash.nn.make_flax_attention_fn(is_causal=True)

An explicit ``mask`` or ``bias`` still works: that call runs
``jax.nn.dot_product_attention``'s XLA path (or raises with
``implementation="flash"``), exactly as in ``jax_flash.dot_product_attention``.

Equinox: ``MultiheadAttention`` mirrors ``equinox.nn.MultiheadAttention``
(same constructor, fields and ``__call__``), plus the static options
``causal`` and ``implementation``. It needs equinox installed; the Flax
functions need only JAX.

Attention sinks (gpt-oss; ``jax_flash.attention``'s ``sinks``): the stock
Flax layers have no parameter for them, so ``flax_attention_fn`` takes
``sinks=`` and a parent linen module binds its own parameter::

  sinks = self.param("sinks", nn.initializers.zeros, (num_heads,))
  attention_fn = functools.partial(jax_flash.nn.flax_attention_fn, sinks=sinks)

(an NNX layer fixes its ``attention_fn`` when built: call
``flax_attention_fn(q, k, v, sinks=self.sinks.value)`` from a module of your
own). The Equinox layer holds them itself with ``use_sinks=True``.
"""

import math

import jax
import jax.numpy as jnp

from jax_flash import _api as api

try:
  import equinox as eqx
except ImportError:  # the Flax half of this module does not need it
  eqx = None

_DROPOUT_MESSAGE = (
    "jax_flash never forms the attention probabilities, so it cannot apply dropout to "
    "them; use dropout_rate=0 (dropout elsewhere in the block is unaffected), run "
    "deterministically, or use the stock attention function for this layer")


def _promote(query, key, value, dtype, promote_dtype):
  if promote_dtype is not None:  # NNX hands its own promotion function down
    return promote_dtype((query, key, value), dtype=dtype)
  dtype = jnp.result_type(query, key, value) if dtype is None else dtype
  return tuple(jnp.asarray(x, dtype) for x in (query, key, value))


def _flatten_batch(x, batch_shape, trailing: int):
  """Broadcasts ``x``'s leading dims to ``batch_shape`` and folds them into one,
  keeping its last ``trailing`` dims (``None`` passes through)."""
  if x is None:
    return None
  x = jnp.broadcast_to(x, (*batch_shape, *x.shape[x.ndim - trailing:]))
  return x.reshape(-1, *x.shape[len(batch_shape):])


def make_flax_attention_fn(*, is_causal: bool = False, local_window_size=None,
                           implementation: str | None = None):
  """Returns an ``attention_fn`` for Flax's attention layers that runs jax_flash.

  Args:
    is_causal: always apply a causal mask (top-left aligned, as in
      ``jax.nn.dot_product_attention``). Combines with the ``is_causal`` that
      ``nnx.MultiHeadAttention`` passes at call time.
    local_window_size: ``jax.nn``'s sliding window, ``(left, right)`` or an int.
    implementation: as in ``jax_flash.dot_product_attention``: ``None`` falls
      back to XLA for what the kernels do not cover (masks, biases), ``"flash"``
      raises ``NotImplementedError`` instead.

  The returned function has the signature of ``flax.linen.dot_product_attention``
  and ``flax.nnx.dot_product_attention``. It raises ``NotImplementedError`` for
  what a fused kernel cannot do: dropout on the attention probabilities (when
  not deterministic), sowing the attention weights, and custom einsums.
  ``precision`` is ignored (the kernels accumulate in float32), and so is
  ``force_fp32_for_softmax`` (the softmax always runs in float32).

  The returned function also takes ``sinks``, float32 ``[num_heads]``
  (``jax_flash.attention``'s; the stock layers never pass it: see the module
  docstring). With sinks the mask must be structure: an explicit ``mask``
  or ``bias`` raises ``NotImplementedError`` (``jax.nn``'s XLA path, the
  fallback for them, has no sinks), as does ``implementation="cudnn"``.
  """
  always_causal = is_causal

  def flax_attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                        dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                        precision=None, module=None, force_fp32_for_softmax=False,
                        qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                        promote_dtype=None, is_causal=False, sinks=None):
    """Flax-compatible attention over ``[batch..., length, heads, depth]``
    inputs, computed by jax_flash. See ``jax_flash.nn.make_flax_attention_fn``."""
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    if dropout_rate > 0.0 and not deterministic:
      raise NotImplementedError(f"dropout_rate={dropout_rate}: {_DROPOUT_MESSAGE}")
    if module is not None:
      raise NotImplementedError("sow_weights=True: jax_flash never forms the attention "
                                "weights; use the stock attention function to inspect them")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
      raise NotImplementedError("custom attention einsums (e.g. AQT quantisation) cannot run "
                                "inside the fused jax_flash kernel")
    query, key, value = _promote(query, key, value, dtype, promote_dtype)
    if mask is not None:
      mask = jnp.asarray(mask, jnp.bool_)
    batch_shape = query.shape[:-3]
    if len(batch_shape) > 1:  # jax.nn layouts have at most one batch dim
      query, key, value = (_flatten_batch(x, batch_shape, 3) for x in (query, key, value))
      bias, mask = (_flatten_batch(x, batch_shape, 3) for x in (bias, mask))
    if sinks is None:
      out = api.dot_product_attention(
          query, key, value, bias, mask, is_causal=always_causal or is_causal,
          local_window_size=local_window_size, implementation=implementation)
    else:
      out = _attention_with_sinks(query, key, value, bias, mask, sinks,
                                  is_causal=always_causal or is_causal,
                                  local_window_size=local_window_size,
                                  implementation=implementation)
    return out.reshape(*batch_shape, *out.shape[-3:])

  return flax_attention_fn


def _attention_with_sinks(query, key, value, bias, mask, sinks, *, is_causal, local_window_size,
                          implementation):
  """``flax_attention_fn``'s call with sinks: jax.nn's conventions, the
  kernels (or jax_flash's XLA path for ``implementation="xla"``)."""
  unsupported = [name for name, x in (("a bias", bias), ("a mask", mask)) if x is not None]
  if implementation == "cudnn":
    unsupported.append("implementation='cudnn'")
  if unsupported:
    raise NotImplementedError(
        f"attention sinks with {unsupported[0]}: jax.nn.dot_product_attention has no sinks; "
        "pass the mask as structure (make_flax_attention_fn(is_causal=..., "
        "local_window_size=...))")
  out, _ = api._jax_nn_conventions(
      query, key, value, scale=None, is_causal=is_causal, query_seq_lengths=None,
      key_value_seq_lengths=None, local_window_size=local_window_size,
      implementation=implementation if implementation == "xla" else (
          None if implementation is None else "flash"),
      sinks=sinks)
  return out


flax_attention_fn = make_flax_attention_fn()
flax_attention_fn.__doc__ = (
    "``attention_fn`` for ``flax.linen.MultiHeadDotProductAttention`` and "
    "``flax.nnx.MultiHeadAttention`` that runs jax_flash; "
    "``make_flax_attention_fn(is_causal=True, ...)`` builds variants.")


def _masked_attention(query, key, value, mask, causal: bool, sinks=None):
  """Attention with an explicit boolean mask ``[heads or 1, seq_q, seq_k]`` on
  ``[seq, heads, dim]`` inputs, in float32; rows without keys output zeros.
  ``sinks`` ``[heads]`` join each row's softmax as a column without a value."""
  logits = jnp.einsum("tnh,snh->nts", query, key, preferred_element_type=jnp.float32)
  logits = logits / math.sqrt(query.shape[-1])
  if causal:
    seq_q, seq_k = logits.shape[-2:]
    rows = jnp.arange(seq_q)[:, None] + (seq_k - seq_q)
    mask = mask & (jnp.arange(seq_k)[None, :] <= rows)
  logits = jnp.where(mask, logits, -jnp.inf)
  seq_k = logits.shape[-1]
  if sinks is not None:
    column = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (*logits.shape[:-1], 1))
    logits = jnp.concatenate([logits, column], axis=-1)
  row_max = jnp.max(logits, axis=-1, keepdims=True)
  weights = jnp.exp(logits - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  total = jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights / jnp.where(total > 0, total, 1.0)
  out = jnp.einsum("nts,snh->tnh", weights[..., :seq_k], value.astype(jnp.float32))
  return out.astype(value.dtype)


if eqx is not None:

  class MultiheadAttention(eqx.Module):
    """``equinox.nn.MultiheadAttention`` with jax_flash computing the attention.

    Constructor arguments, fields (so parameters and ``eqx.tree_at`` paths) and
    ``__call__`` are those of the stock layer, which makes the two
    interchangeable; the same ``key`` gives the same parameters. Inputs are
    unbatched, ``[seq, features]``; ``jax.vmap`` over a batch as usual.

    Extra keyword-only constructor options:
      causal: each query attends to the keys at or before its position (the
        diagonal is aligned bottom-right when ``kv_seq > q_seq``, the decoding
        convention of ``jax_flash.attention``); this runs in the kernels,
        where a ``mask`` array cannot.
      implementation: passed to ``jax_flash.attention``.
      use_sinks: give the layer attention sinks (``jax_flash.attention``'s
        ``sinks``): a float32 ``[num_heads]`` field ``sinks``, trained with the
        other parameters and initialised to zeros. Without it ``sinks`` is
        ``None``, which adds no leaf to the layer's pytree.

    A ``mask`` passed to ``__call__`` is honoured with a plain XLA computation
    (combined with ``causal``). Dropout on the attention weights
    (``dropout_p > 0`` outside inference mode) raises ``NotImplementedError``.
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    dropout: eqx.nn.Dropout
    sinks: jax.Array | None

    num_heads: int = eqx.field(static=True)
    query_size: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    output_size: int = eqx.field(static=True)
    qk_size: int = eqx.field(static=True)
    vo_size: int = eqx.field(static=True)
    use_query_bias: bool = eqx.field(static=True)
    use_key_bias: bool = eqx.field(static=True)
    use_value_bias: bool = eqx.field(static=True)
    use_output_bias: bool = eqx.field(static=True)
    causal: bool = eqx.field(static=True)
    implementation: str | None = eqx.field(static=True)

    def __init__(self, num_heads: int, query_size: int, key_size: int | None = None,
                 value_size: int | None = None, output_size: int | None = None,
                 qk_size: int | None = None, vo_size: int | None = None,
                 use_query_bias: bool = False, use_key_bias: bool = False,
                 use_value_bias: bool = False, use_output_bias: bool = False,
                 dropout_p: float = 0.0, inference: bool = False, dtype=None, *, key,
                 causal: bool = False, implementation: str | None = None,
                 use_sinks: bool = False):
      """Arguments as ``equinox.nn.MultiheadAttention``, plus ``causal``,
      ``implementation`` and ``use_sinks`` (see the class docstring)."""
      # Same defaults and the same split of ``key`` as the stock layer, so
      # that one key initialises both identically.
      key_size = query_size if key_size is None else key_size
      value_size = query_size if value_size is None else value_size
      output_size = query_size if output_size is None else output_size
      qk_size = query_size // num_heads if qk_size is None else qk_size
      vo_size = query_size // num_heads if vo_size is None else vo_size
      qkey, kkey, vkey, okey = jax.random.split(key, 4)
      self.query_proj = eqx.nn.Linear(query_size, num_heads * qk_size, use_bias=use_query_bias,
                                      dtype=dtype, key=qkey)
      self.key_proj = eqx.nn.Linear(key_size, num_heads * qk_size, use_bias=use_key_bias,
                                    dtype=dtype, key=kkey)
      self.value_proj = eqx.nn.Linear(value_size, num_heads * vo_size, use_bias=use_value_bias,
                                      dtype=dtype, key=vkey)
      self.output_proj = eqx.nn.Linear(num_heads * vo_size, output_size,
                                       use_bias=use_output_bias, dtype=dtype, key=okey)
      self.dropout = eqx.nn.Dropout(dropout_p, inference=inference)
      # Zeros: a sink of 0 weighs like one more key of logit 0.
      self.sinks = jnp.zeros(num_heads, jnp.float32) if use_sinks else None
      self.num_heads = num_heads
      self.query_size = query_size
      self.key_size = key_size
      self.value_size = value_size
      self.output_size = output_size
      self.qk_size = qk_size
      self.vo_size = vo_size
      self.use_query_bias = use_query_bias
      self.use_key_bias = use_key_bias
      self.use_value_bias = use_value_bias
      self.use_output_bias = use_output_bias
      self.causal = causal
      self.implementation = implementation

    def __call__(self, query, key_, value, mask=None, *, key=None, inference=None,
                 deterministic=None, process_heads=None):
      """Attention of ``query [q_seq, query_size]`` over ``key_ [kv_seq,
      key_size]`` / ``value [kv_seq, value_size]``; returns ``[q_seq,
      output_size]``. ``mask`` is boolean ``[q_seq, kv_seq]`` or ``[num_heads,
      q_seq, kv_seq]`` (``False`` hides a key); ``key`` is the dropout key,
      unused here; ``inference`` / ``deterministic`` and ``process_heads`` are
      as in ``equinox.nn.MultiheadAttention``."""
      del key
      if deterministic is not None:
        inference = deterministic
      if inference is None:
        inference = self.dropout.inference
      if self.dropout.p > 0 and not inference:
        raise NotImplementedError(f"dropout_p={self.dropout.p}: {_DROPOUT_MESSAGE}")
      if key_.shape[0] != value.shape[0]:
        raise ValueError(f"key_ and value must have the same length, got {key_.shape[0]} "
                         f"and {value.shape[0]}")
      heads = tuple(self._project(proj, x) for proj, x in (
          (self.query_proj, query), (self.key_proj, key_), (self.value_proj, value)))
      if process_heads is not None:
        processed = tuple(process_heads(*heads))
        shapes = [x.shape for x in heads]
        if [x.shape for x in processed] != shapes:
          raise ValueError(f"process_heads must keep the heads' shapes {shapes}, got "
                           f"{[x.shape for x in processed]}")
        heads = processed
      query_heads, key_heads, value_heads = heads
      if mask is None:
        attn = api.attention(query_heads[None], key_heads[None], value_heads[None],
                             causal=self.causal, sinks=self.sinks,
                             implementation=self.implementation)[0]
      else:
        mask = jnp.asarray(mask, jnp.bool_)
        expected = (query.shape[0], key_.shape[0])
        if mask.shape not in (expected, (self.num_heads, *expected)):
          raise ValueError(f"mask must have shape {expected} or {(self.num_heads, *expected)}, "
                           f"got {mask.shape}")
        mask = mask if mask.ndim == 3 else mask[None]
        attn = _masked_attention(query_heads, key_heads, value_heads, mask, self.causal,
                                 self.sinks)
      return jax.vmap(self.output_proj)(attn.reshape(query.shape[0], -1))

    def _project(self, proj, x):
      return jax.vmap(proj)(x).reshape(x.shape[0], self.num_heads, -1)
