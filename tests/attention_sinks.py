"""Attention sinks (issue 52) in the shared specification: ``SinksSpec`` is a
base of ``attention_base.AttentionTestBase``, so every backend class runs it.

The truth is ``reference.attention_reference`` with the sink as one more
softmax column (in float64), independent of where jax_flash adds the sink
(the Hopper forward kernel's epilogue, else ``jax_flash/_sinks.py`` after
the call; tests/test_sinks_kernel.py checks which). Gradients flow from random
cotangents of both ``out`` and ``lse`` (a loss through the lse is how the
sink's gradient mixes the two), to q, k, v and the sinks.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import numerics
from jax_flash import _reference as reference

NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _base():
  """attention_base, for its mask helpers: imported when a test runs, as it
  imports this module for SinksSpec."""
  import attention_base
  return attention_base


def sink_values(heads_q: int, seed: int = 0):
  """float32 [heads_q] sinks from well below to well above a typical lse
  (about log of the keys seen, 3-7 here), so that the sink's share of a
  row's softmax ranges from almost nothing to most of it."""
  jitter = jax.random.uniform(jax.random.key(seed), (heads_q,), jnp.float32, -0.5, 0.5)
  return jnp.linspace(-2.0, 9.0, heads_q, dtype=jnp.float32) + jitter


def random_cotangents(seed, out_shape, lse_shape, dtype):
  keys = jax.random.split(jax.random.key(seed + 1000), 2)
  return (jax.random.normal(keys[0], out_shape, jnp.float32).astype(dtype),
          jax.random.normal(keys[1], lse_shape, jnp.float32))


def run_with_sinks(q, k, v, sinks, dout, dlse, implementation, **kwargs):
  """(out, lse, dq, dk, dv, dsinks) of jax_flash.attention under jit, as
  float32 NumPy arrays; ``sinks=None`` runs without sinks (no dsinks)."""

  def attend(q, k, v, *sinks):
    return jax_flash.attention(q, k, v, sinks=sinks[0] if sinks else None, return_lse=True,
                               implementation=implementation, **kwargs)

  @jax.jit
  def forward_backward(dout, dlse, *args):
    (out, lse), pullback = jax.vjp(attend, *args)
    return (out, lse, *pullback((dout, dlse)))

  args = (q, k, v) if sinks is None else (q, k, v, sinks)
  return tuple(np.asarray(jnp.asarray(x, jnp.float32)) for x in forward_backward(dout, dlse, *args))


@functools.cache
def _jitted_reference(compute_dtype, static):
  @jax.jit
  def outputs(q, k, v, sinks, dout, dlse, arrays):
    def run(q, k, v, sinks):
      return reference.attention_reference(q, k, v, sinks=sinks, compute_dtype=compute_dtype,
                                           **dict(static), **arrays)

    (out, lse), pullback = jax.vjp(run, q, k, v, sinks)
    return (out, lse, *pullback((dout.astype(out.dtype), dlse.astype(lse.dtype))))

  return outputs


def reference_with_sinks(q, k, v, sinks, dout, dlse, *, compute_dtype, **mask):
  """(out, lse, dq, dk, dv, dsinks) of the reference in ``compute_dtype``
  (None: the naive implementation in the input dtype) as float64 NumPy."""
  arrays = {name: x for name, x in mask.items() if isinstance(x, (jax.Array, np.ndarray))}
  static = tuple(sorted((name, x) for name, x in mask.items() if name not in arrays))
  outputs = _jitted_reference(compute_dtype, static)(q, k, v, sinks, dout, dlse, arrays)
  return tuple(numerics._to64(x) for x in outputs)


def assert_matches_sink_reference(got, q, k, v, sinks, dout, dlse, **mask):
  """The tolerance principle on all six results against the float64 truth."""
  with jax.enable_x64(True):
    wide = [jnp.asarray(numerics._to64(x)) for x in (q, k, v, sinks, dout, dlse)]
    ref = reference_with_sinks(*wide, compute_dtype=jnp.float64, **mask)
  naive = reference_with_sinks(q, k, v, sinks, dout, dlse, compute_dtype=None, **mask)
  for name, g, r, n in zip(NAMES, got, ref, naive):
    numerics.assert_within_tolerance(name, g, r, n, q.dtype,
                                     reduction=max(q.shape[1], k.shape[1]))


class SinksSpec:
  implementation: str
  dtypes: tuple
  head_dims: tuple

  def check_sinks(self, *, batch=2, seq_q=113, seq_k=241, heads_q=4, heads_kv=2, head_dim=None,
                  dtype=None, causal=False, window=None, q_lens=None, kv_lens=None,
                  segment_ids=None, softcap=None, deterministic=False, seed=0):
    """Runs attention with sinks and checks it against the reference;
    returns the results and the sinks."""
    head_dim = head_dim or self.head_dims[0]
    dtype = dtype or self.dtypes[0]
    q, k, v, dout = numerics.random_qkv(seed, batch, seq_q, seq_k, heads_q, heads_kv, head_dim,
                                        dtype)
    sinks = sink_values(heads_q, seed)
    dout, dlse = random_cotangents(seed, dout.shape, (batch, heads_q, seq_q), dtype)
    got = run_with_sinks(q, k, v, sinks, dout, dlse, self.implementation, causal=causal,
                         window=window, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
                         segment_ids=segment_ids, softcap=softcap, deterministic=deterministic)
    mask = _base().mask_kwargs(seq_q, seq_k, causal, window, q_lens, kv_lens, segment_ids)
    assert_matches_sink_reference(got, q, k, v, sinks, dout, dlse,
                                  scale=1.0 / np.sqrt(head_dim), softcap=softcap or 0.0, **mask)
    return got, sinks

  @pytest.mark.parametrize("case", [
      "causal-gqa", "documents-window-softcap",
      *(pytest.param(case, marks=pytest.mark.slow) for case in (
          "full", "window", "mqa", "softcap", "decode", "cross-documents", "many-keys",
          "deterministic"))])
  def test_sinks_match_reference(self, case):
    kw = {
        "causal-gqa": dict(causal=True, heads_q=8, heads_kv=2),
        "documents-window-softcap": dict(
            seq_q=260, seq_k=260, window=(70, 0), softcap=3.0,
            segment_ids=_base().packed_segment_ids(14, batch=2, seq=260, num_docs=3)),
        "full": {},
        "window": dict(seq_q=150, seq_k=150, window=(16, 8)),
        "mqa": dict(heads_q=8, heads_kv=1, causal=True),
        "softcap": dict(causal=True, softcap=1.5),
        # GQA heads packed into one tile, an empty cache (its rows see only the sink)
        "decode": dict(batch=3, seq_q=1, seq_k=700, heads_q=8, heads_kv=2, causal=True,
                       kv_lens=jnp.array([700, 90, 0], jnp.int32)),
        "cross-documents": dict(
            seq_q=120, seq_k=200,
            segment_ids=(_base().packed_segment_ids(9, batch=2, seq=120, num_docs=4,
                                                           padding=7),
                         _base().packed_segment_ids(10, batch=2, seq=200, num_docs=4))),
        "many-keys": dict(batch=1, seq_q=130, seq_k=1100, heads_q=2, heads_kv=1),
        "deterministic": dict(causal=True, heads_q=8, heads_kv=2, deterministic=True),
    }[case]
    got, _ = self.check_sinks(**kw)
    if case == "deterministic":  # d_sinks too: a sum over rows in a fixed order
      chex.assert_trees_all_equal(got, self.check_sinks(**kw)[0])

  @pytest.mark.slow
  @pytest.mark.parametrize("head_dim_v", [None, 128], ids=["same", "192-128"])
  def test_sinks_at_every_dtype(self, dtype, head_dim_v):
    # Each dtype of the backend; 192 / 128 is DeepSeek's shape (kernels of its own on Hopper).
    head_dim = 192 if head_dim_v else self.head_dims[0]
    q, k, v, dout = numerics.random_qkv(3, 1, 150, 150, 4, 2, head_dim, dtype, head_dim_v)
    sinks = sink_values(4, 3)
    dout, dlse = random_cotangents(3, dout.shape, (1, 4, 150), dtype)
    got = run_with_sinks(q, k, v, sinks, dout, dlse, self.implementation, causal=True)
    mask = _base().mask_kwargs(150, 150, causal=True)
    assert_matches_sink_reference(got, q, k, v, sinks, dout, dlse, scale=head_dim ** -0.5,
                                  **mask)

  def test_sinks_rows_without_keys(self):
    # Query lengths (0 for a whole sequence), keys cut short and the
    # bottom-right causal mask leave rows that see no key: they output
    # zeros with lse equal to their head's sink, and get no q gradient.
    q_lens = jnp.array([90, 0], jnp.int32)
    kv_lens = jnp.array([30, 41], jnp.int32)
    (out, lse, dq, dk, dv, dsinks), sinks = self.check_sinks(
        seq_q=100, seq_k=41, causal=True, q_lens=q_lens, kv_lens=kv_lens)
    seen = np.zeros((2, 100), bool)
    seen[0, 59:90] = True  # row t sees keys up to t - 59
    assert np.all(out[~seen] == 0) and np.all(dq[~seen] == 0)
    expected_lse = np.broadcast_to(np.asarray(sinks)[None, :, None], lse.shape)
    np.testing.assert_array_equal(np.swapaxes(lse, 1, 2)[~seen],
                                  np.swapaxes(expected_lse, 1, 2)[~seen])
    assert np.all(np.isfinite(dk)) and np.all(np.isfinite(dv)) and np.all(np.isfinite(dsinks))

  @pytest.mark.parametrize("mask", ["causal-lengths", pytest.param("documents",
                                                                    marks=pytest.mark.slow)])
  def test_sinks_of_minus_inf_are_no_sinks(self, mask):
    # Bit for bit, outputs and gradients (an lse cotangent included), rows
    # without keys too.
    kw = (dict(causal=True, query_seq_lengths=jnp.array([150, 40], jnp.int32),
               key_value_seq_lengths=jnp.array([70, 100], jnp.int32)) if mask == "causal-lengths"
          else dict(segment_ids=_base().packed_segment_ids(5, 2, 100, num_docs=3,
                                                                  padding=9)))
    q, k, v, dout = numerics.random_qkv(4, 2, 150 if mask != "documents" else 100, 100, 4, 2,
                                        self.head_dims[0], self.dtypes[0])
    dout, dlse = random_cotangents(4, dout.shape, (2, 4, q.shape[1]), self.dtypes[0])
    none = jnp.full((4,), -jnp.inf, jnp.float32)
    with_none = run_with_sinks(q, k, v, none, dout, dlse, self.implementation, deterministic=True,
                               **kw)
    without = run_with_sinks(q, k, v, None, dout, dlse, self.implementation, deterministic=True,
                             **kw)
    chex.assert_trees_all_equal(with_none[:5], without)

  @pytest.mark.slow
  def test_varlen_with_sinks_matches_separate_documents(self):
    offsets = [0, 37, 38, 200, 310]
    total = 330  # 20 tokens of padding past the last document
    q, k, v, _ = numerics.random_qkv(13, 1, total, total, 4, 2, self.head_dims[0],
                                     self.dtypes[0])
    sinks = sink_values(4, 13)
    packed, lse = jax_flash.varlen_attention(q[0], k[0], v[0], jnp.array(offsets, jnp.int32),
                                             causal=True, sinks=sinks, return_lse=True,
                                             implementation=self.implementation)
    for start, end in zip(offsets[:-1], offsets[1:]):
      alone = jax_flash.attention(q[:, start:end], k[:, start:end], v[:, start:end],
                                  causal=True, sinks=sinks, implementation=self.implementation)
      chex.assert_trees_all_close(packed[start:end], alone[0], atol=1e-2 if
                                  self.dtypes[0] != jnp.float32 else 1e-5, rtol=1e-2)
    assert np.all(np.asarray(packed[offsets[-1]:]) == 0)
    np.testing.assert_array_equal(np.asarray(lse[:, offsets[-1]:]),
                                  np.broadcast_to(np.asarray(sinks)[:, None], (4, 20)))

  @pytest.mark.parametrize("sinks,match", [
      (jnp.zeros((1, 4), jnp.float32), r"sinks must have rank 1 \[heads_q=4\], got shape \(1, 4\)"),
      (jnp.zeros((2,), jnp.float32), r"sinks must have shape \(4,\) \[heads_q\], got \(2,\)"),
      (jnp.zeros((4,), jnp.bfloat16), "sinks must have dtype float32, got bfloat16"),
      ([0.0] * 4, r"sinks must be None or a float32 array \[heads_q=4\], got list"),
  ], ids=["rank", "shape", "dtype", "list"])
  def test_bad_sinks_raise(self, sinks, match):
    q = jnp.zeros((1, 8, 4, self.head_dims[0]), self.dtypes[0])
    k = v = jnp.zeros((1, 8, 2, self.head_dims[0]), self.dtypes[0])
    with pytest.raises(ValueError, match=match):
      jax_flash.attention(q, k, v, sinks=sinks, implementation=self.implementation)
