"""paged_attention with attention sinks: a NumPy reference that puts the sink
in each row's softmax as one more column, per sequence over contiguous keys
(test_paged.make_batch: shuffled pages, NaN / Inf in every unused slot and
in the padding rows' queries)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import numerics
from attention_sinks import sink_values
from test_paged import make_batch

# Ragged new tokens (decode, a prefill chunk, an empty slot), awkward lengths.
CACHE_LENGTHS, QUERY_LENGTHS = [1, 300, 33, 0], [1, 17, 5, 0]


def sink_reference(inputs, keys, values, sinks, *, causal=True, window=None, dtype=np.float64):
  """(out, lse) with sinks, sequence by sequence, in float64; for another
  ``dtype``, float32 sums rounded to it (the naive implementation)."""
  q = np.asarray(jnp.asarray(inputs["q"], jnp.float32), np.float64)
  batch, max_new, heads_q, head_dim = q.shape
  group = heads_q // keys[0].shape[1]
  rounded = ((lambda x: x) if dtype == np.float64 else
             (lambda x: np.asarray(np.asarray(x, np.float32).astype(dtype), np.float64)))
  left, right = (-1, -1) if window is None else window
  right = (0 if right < 0 else min(right, 0)) if causal else right
  out = np.zeros((batch, max_new, heads_q, values[0].shape[-1]))
  lse = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None],
                        (batch, heads_q, max_new)).copy()  # rows without keys
  for b, (length, new) in enumerate(zip(np.asarray(inputs["cache_lengths"]),
                                        np.asarray(inputs["query_lengths"]))):
    k = np.repeat(keys[b], group, axis=1).astype(np.float64)
    v = np.repeat(values[b], group, axis=1).astype(np.float64)
    logits = rounded(np.einsum("thd,shd->hts", q[b, :new], k) / np.sqrt(head_dim))
    position = length - new + np.arange(new)[:, None]
    key = np.arange(length)[None, :]
    visible = np.ones((new, length), bool)
    if left >= 0:
      visible &= key >= position - left
    if right >= 0:
      visible &= key <= position + right
    logits = np.where(visible[None], logits, -np.inf)
    sink_column = np.broadcast_to(np.asarray(sinks, np.float64)[:, None, None], (heads_q, new, 1))
    logits = np.concatenate([logits, sink_column], axis=-1)
    top = logits.max(-1, keepdims=True)
    weights = np.exp(logits - top)
    total = weights.sum(-1, keepdims=True)
    probs = rounded(weights[..., :length] / total)
    out[b, :new] = rounded(np.einsum("hts,shd->thd", probs, v))
    lse[b, :, :new] = (top + np.log(total))[..., 0]
  return out, lse


def run_paged(inputs, implementation, sinks, **options):
  """(out, lse) as float64 NumPy, under jit with the sinks traced."""
  attend = jax.jit(functools.partial(jax_flash.paged_attention, return_lse=True,
                                     implementation=implementation, **options))
  out, lse = attend(**inputs, sinks=sinks)
  return np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)


class PagedSinkChecks:
  implementation: str
  dtype = jnp.float32
  head_dim = 64

  def check(self, seed, page_size, **kwargs):
    inputs, keys, values = make_batch(seed, CACHE_LENGTHS, QUERY_LENGTHS, page_size=page_size,
                                      head_dim=self.head_dim, dtype=self.dtype)
    sinks = sink_values(inputs["q"].shape[2], seed)
    got = run_paged(inputs, self.implementation, sinks, **kwargs)
    ref = sink_reference(inputs, keys, values, sinks, **kwargs)
    naive = sink_reference(inputs, keys, values, sinks, dtype=self.dtype, **kwargs)
    for name, g, r, n in zip(("out", "lse"), got, ref, naive):
      numerics.assert_within_tolerance(f"{name} {kwargs}", g, r, n, self.dtype,
                                       reduction=max(CACHE_LENGTHS))
    return inputs, sinks, got

  @pytest.mark.parametrize("mask", [{}, {"causal": False, "window": (20, 3)}],
                           ids=["causal", "window"])
  def test_matches_reference(self, mask):
    inputs, sinks, (out, lse) = self.check(3, 16, **mask)
    # The empty slot and the padding rows (NaN queries): zeros, lse = the sink.
    padding = np.arange(out.shape[1])[None] >= np.asarray(inputs["query_lengths"])[:, None]
    assert np.all(out[padding] == 0)
    np.testing.assert_array_equal(np.swapaxes(lse, 1, 2)[padding],
                                  np.broadcast_to(np.asarray(sinks), (padding.sum(), 8)))

  def test_sinks_of_minus_inf_are_no_sinks(self):
    inputs = make_batch(4, CACHE_LENGTHS, QUERY_LENGTHS, page_size=32, head_dim=self.head_dim,
                        dtype=self.dtype)[0]
    none = jnp.full((inputs["q"].shape[2],), -jnp.inf, jnp.float32)
    with_none = run_paged(inputs, self.implementation, none)
    without = run_paged(inputs, self.implementation, None)
    chex.assert_trees_all_equal(with_none, without)


class TestPagedSinksCpu(PagedSinkChecks):
  implementation = None  # the C++ kernel on a CPU

  @pytest.fixture(autouse=True)
  def _on_cpu(self):
    if jax.default_backend() != "cpu":
      pytest.skip(f"CPU checks; this process's default backend is {jax.default_backend()}")

  def test_bad_sinks_raise(self):
    inputs = make_batch(5, [5], [1], page_size=16, head_dim=8)[0]
    with pytest.raises(ValueError, match=r"sinks must have shape \(8,\) \[heads_q\], got \(2,\)"):
      run_paged(inputs, None, jnp.zeros(2, jnp.float32))


@pytest.mark.slow
class TestPagedSinksXla(TestPagedSinksCpu):
  implementation = "xla"


@pytest.mark.gpu
class TestPagedSinksGpu(PagedSinkChecks):
  implementation = "flash"  # the Hopper kernel
  dtype = jnp.bfloat16
  head_dim = 128
