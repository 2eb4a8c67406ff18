"""The checks every jax_flash MLA kernel satisfies (implementation="flash"):
test_mla_gpu.py runs them on the Hopper kernels, test_mla_cpu.py on the CPU
kernel, each through test_mla.py's helpers and references."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_flash import _mla as mla, _mla_fp8 as mla_fp8
from test_mla import (BATCHES, DOMINANT_PAGES, PAGE, WIDTH, assert_matches,
                      assert_sinks_join_after_the_merge, finite_or_zero, make_batch, place_sequence,
                      run, sink_values, with_dominant_pages)


class MlaKernelChecks:
  """What jax_flash's MLA kernels satisfy (implementation="flash"):
  test_mla_gpu.py runs them on the Hopper kernels, test_mla_cpu.TestMlaCpu on
  the CPU kernel. conftest.py parametrises the tests' dtype from ``dtypes``,
  the cache formats (float8_e4m3fn: the MlaFp8Cache, bfloat16 queries);
  ``fp8_floor``: the rounding floor of the FP8 cache's comparisons
  (assert_matches)."""
  dtypes = (jnp.bfloat16, jnp.float16)
  fp8_floor = jnp.float32

  def run(self, inputs, **kwargs):
    return run(inputs, implementation="flash", **kwargs)

  @staticmethod
  def batch(seed, lengths, new, dtype, **kwargs):
    fp8 = jnp.dtype(dtype) == mla_fp8.FP8_DTYPE
    return make_batch(seed, lengths, new, fp8=fp8, dtype=jnp.bfloat16 if fp8 else dtype,
                      **kwargs)

  def test_matches_float64(self, dtype):
    for lengths, new in BATCHES:
      inputs, rows = self.batch(len(lengths), lengths, new, dtype)
      assert_matches(self.run(inputs), inputs, rows, f"{lengths} {new}", self.fp8_floor)

  @pytest.mark.parametrize("heads, s_q", [
      (16, 1), (16, 2), (128, 2), pytest.param(64, 1, marks=pytest.mark.slow),
      pytest.param(64, 2, marks=pytest.mark.slow), pytest.param(128, 1, marks=pytest.mark.slow)])
  def test_heads_and_speculative_rows(self, dtype, heads, s_q):
    # 4097 keys: GPU splits of 1024 or 2048 keys, the last of one key; 300: 5 pages.
    lengths = [4097, 1000, 17, 1, 300]
    new = [s_q, 1, s_q, 1, s_q]
    inputs, rows = self.batch(heads + s_q, lengths, new, dtype, heads=heads)
    assert_matches(self.run(inputs), inputs, rows, f"heads {heads} s_q {s_q}", self.fp8_floor)

  def test_batch_invariant(self, dtype):
    """A sequence's rows bitwise: alone and in another slot of a larger
    batch, its pages elsewhere in a larger pool, beside longer sequences
    (more splits) and another table width."""
    batch = self.batch(9, [70, 9000, 3000, 1], [1, 2, 2, 1], dtype, spare_pages=20,
                       heads=128)[0]
    alone = self.batch(8, [3000], [2], dtype, heads=128)[0]
    got_alone = self.run(alone)
    got_mixed = self.run(place_sequence(batch, 2, alone))
    np.testing.assert_array_equal(got_mixed[0][2], got_alone[0][0])
    np.testing.assert_array_equal(got_mixed[1][2], got_alone[1][0])

  def test_kv_split_size(self, dtype):
    """Other split sizes (4097 keys in 22 splits of 192: three pages each)
    match the reference, and a sequence's rows are bitwise the same alone and
    in a batch with each (a split longer than every table: one split)."""
    inputs, rows = self.batch(44, [4097, 1000, 17, 1], [2, 1, 2, 1], dtype, heads=16)
    for size in (192, 4096):
      assert_matches(self.run(inputs, kv_split_size=size), inputs, rows,
                     f"kv_split_size {size}", self.fp8_floor)
    batch = self.batch(9, [70, 9000, 3000, 1], [1, 2, 2, 1], dtype, spare_pages=20, heads=16)[0]
    alone = self.batch(8, [3000], [2], dtype, heads=16)[0]
    mixed = place_sequence(batch, 2, alone)
    for size in (128, 1 << 20):
      got_alone, got_mixed = (self.run(x, kv_split_size=size) for x in (alone, mixed))
      np.testing.assert_array_equal(got_mixed[0][2], got_alone[0][0])
      np.testing.assert_array_equal(got_mixed[1][2], got_alone[1][0])

  def test_unseen_positions_never_reach_results(self, dtype):
    inputs, _ = self.batch(12, [1000, 300, 5, 4097], [2, 1, 0, 2], dtype)
    clean = dict(inputs, q=finite_or_zero(inputs["q"]), cache=finite_or_zero(inputs["cache"]))
    got, want = self.run(inputs), self.run(clean)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert np.isfinite(got[0]).all()

  def test_visible_nan_reaches_exactly_the_rows_that_see_it(self, dtype):
    """A non-finite value in token 999 of sequence 0, visible to its second
    row only; in the FP8 cache in each part: a NaN scale or code, an Inf of
    either sign in a RoPE column (a logit of -inf would otherwise just hide
    the key)."""
    inputs, _ = self.batch(21, [1000, 90], [2, 1], dtype)
    page, row = int(inputs["page_table"][0, 999 // PAGE]), 999 % PAGE
    cache = inputs["cache"]
    if isinstance(cache, mla.MlaFp8Cache):
      poisoned = [cache._replace(scales=cache.scales.at[page, row].set(jnp.nan)),
                  cache._replace(latent=cache.latent.at[page, row, 7].set(jnp.nan)),
                  cache._replace(rope=cache.rope.at[page, row, 3].set(jnp.inf)),
                  cache._replace(rope=cache.rope.at[page, row, 3].set(-jnp.inf))]
    else:
      poisoned = [cache.at[page, row, 5].set(jnp.nan)]
    clean_out, clean_lse = self.run(inputs)
    for cache in poisoned:
      out, lse = self.run(dict(inputs, cache=cache))
      # The row that sees token 999 (the first is token 998), every head: all NaN.
      assert np.isnan(out[0, 1]).all() and np.isnan(lse[0, :, 1]).all()
      out[0, 1], lse[0, :, 1] = clean_out[0, 1], clean_lse[0, :, 1]
      np.testing.assert_array_equal(out, clean_out)
      np.testing.assert_array_equal(lse, clean_lse)

  def test_sinks(self, dtype):
    for lengths, new in BATCHES:
      inputs, rows = self.batch(33, lengths, new, dtype)
      inputs["sinks"] = sink_values(16, 33)
      if isinstance(inputs["cache"], mla.MlaFp8Cache):  # the sinks join after the kernel
        assert_sinks_join_after_the_merge(self.run, inputs)
      else:
        assert_matches(self.run(inputs), inputs, rows, f"sinks {lengths} {new}")

  def test_rows_without_keys(self, dtype):
    inputs, _ = self.batch(13, [0, 50], [0, 1], dtype, heads=16, spare_pages=1)
    inputs["query_lengths"] = jnp.asarray([0, 1], jnp.int32)
    inputs["q"] = jnp.ones((2, 2, 16, WIDTH), inputs["q"].dtype)
    out, lse = self.run(inputs)
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
    assert np.all(out[1, 1] == 0) and np.all(lse[1, :, 1] == -np.inf)
    assert np.isfinite(out[1, 0]).all()

  def test_pages_far_apart_in_weight(self, dtype):
    """Keys whose logits reach about +-200 among keys within +-6
    (with_dominant_pages): the running maximum jumps on them (O and the sums
    rescaled by far below 2^-100), and after them the other pages' weights
    lie under float32's smallest normal relative to the largest (where the
    Hopper FP8 kernel's P unit stops at its floor)."""
    lengths, new, pages = DOMINANT_PAGES
    inputs, rows = with_dominant_pages(*self.batch(31, lengths, new, dtype), pages)
    assert_matches(self.run(inputs), inputs, rows, "dominant pages", self.fp8_floor)
