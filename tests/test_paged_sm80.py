"""jax_flash.paged_attention on the sm80 family's paged kernel
(cuda_src/fwd_sm80/paged_loads.py), on a GPU: test_paged.py's batches,
page sizes and masks at the head dims only that kernel serves on Hopper."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_paged import (MASKS, PAGE_SIZES, PAGED_BATCHES, assert_matches_float64,
                        finite_or_zero, make_batch, place_sequence, pool_slot, run_paged)


@pytest.mark.gpu
class TestPagedSm80Gpu:
  """The sm80 family's paged kernel (cuda_src/fwd_sm80/paged_loads.py), at
  the head dims that only it serves on a Hopper GPU (on 8.x it serves
  every head dim): the shared checks' batches, page sizes (48: key tiles
  straddle pages) and masks, with splits that cut the sequences."""
  dtypes = (jnp.bfloat16, jnp.float16)
  head_dims = (96, 192)

  def test_matches_reference(self, dtype, head_dim):
    for (lengths, new), page_size, kwargs in zip(PAGED_BATCHES, PAGE_SIZES, MASKS):
      inputs, keys, values = make_batch(page_size + head_dim, lengths, new, page_size=page_size,
                                        head_dim=head_dim, dtype=dtype)
      got = run_paged(inputs, "flash", kv_split_size=8 * page_size, **kwargs)
      assert_matches_float64(got, inputs, keys, values, dtype,
                             f"{lengths} {new} page {page_size}", **kwargs)

  @pytest.mark.parametrize("heads", [(8, 8), (8, 1), (6, 2)])
  def test_grouped_heads(self, heads, head_dim):
    # Decode rows (a GQA group packed into one tile) and prefill rows.
    inputs, keys, values = make_batch(7, [1000, 33, 17], [1, 4, 17], page_size=48,
                                      heads_q=heads[0], heads_kv=heads[1], head_dim=head_dim,
                                      dtype=jnp.bfloat16)
    assert_matches_float64(run_paged(inputs, "flash", kv_split_size=480), inputs, keys, values,
                           jnp.bfloat16, f"heads {heads}")

  def test_batch_invariant(self, head_dim):
    """A sequence's rows, bitwise: alone, in another slot of a larger batch
    beside other lengths with its pages elsewhere in a larger pool and a
    wider table, and its last token as the last row of a prefill chunk."""
    lengths, new, page = 1000, 1, 48
    run = functools.partial(run_paged, implementation="flash", kv_split_size=384)
    alone = make_batch(8, [lengths], [new], page_size=page, head_dim=head_dim,
                       dtype=jnp.bfloat16)[0]
    batch = make_batch(9, [70, 4000, lengths, 1], [1, 1, new, 1], page_size=page,
                       head_dim=head_dim, dtype=jnp.bfloat16, spare_pages=40)[0]
    got_alone, got_mixed = run(alone), run(place_sequence(batch, 2, alone))
    np.testing.assert_array_equal(got_mixed[0][2], got_alone[0][0])
    np.testing.assert_array_equal(got_mixed[1][2], got_alone[1][0])
    chunk = 37
    prefill = dict(alone, q=jnp.concatenate(
        [jax.random.normal(jax.random.key(1), (1, chunk - 1, 8, head_dim), jnp.bfloat16),
         alone["q"]], axis=1), query_lengths=jnp.asarray([chunk], jnp.int32))
    chunked = run(prefill)
    np.testing.assert_array_equal(chunked[0][0, -1], got_alone[0][0, 0])
    np.testing.assert_array_equal(chunked[1][0, :, -1], got_alone[1][0, :, 0])

  def test_unseen_positions_never_reach_results(self, head_dim):
    """NaN and Inf in unused slots, spare pages, padding rows (make_batch)
    and keys outside every row's window: the bits of a run with zeros
    there."""
    inputs, _, _ = make_batch(12, [1000, 300, 5], [3, 1, 0], page_size=64, head_dim=head_dim,
                              dtype=jnp.bfloat16)
    k_pages, v_pages = np.array(inputs["k_pages"]), np.array(inputs["v_pages"])
    for position in range(900, 1000 - 3 - 20):  # before the window of the first new token
      page, row = pool_slot(inputs, 0, position)
      k_pages[page, row], v_pages[page, row] = np.nan, -np.inf
    poisoned = dict(inputs, k_pages=jnp.asarray(k_pages), v_pages=jnp.asarray(v_pages))
    clean = {**inputs, **{name: finite_or_zero(inputs[name]) for name in ("q", "k_pages",
                                                                         "v_pages")}}
    for kwargs in ({"window": (20, 0)}, {"window": (20, 0), "softcap": 3.0}):
      got = run_paged(poisoned, "flash", kv_split_size=256, **kwargs)
      want = run_paged(clean, "flash", kv_split_size=256, **kwargs)
      np.testing.assert_array_equal(got[0], want[0])
      np.testing.assert_array_equal(got[1], want[1])

  def test_visible_nan_and_inf_propagate(self, head_dim):
    """One entry poisoned: the rows that see it turn non-finite, every other
    result keeps its bits (as PagedChecks' test of the same name)."""
    inputs, _, _ = make_batch(21, [150, 90], [6, 1], page_size=16, head_dim=head_dim,
                              dtype=jnp.bfloat16)
    run = functools.partial(run_paged, implementation="flash", window=(40, 0))
    clean_out, clean_lse = run(inputs)
    clean_lse = np.swapaxes(clean_lse, 1, 2)
    page, row = pool_slot(inputs, 0, 146)
    cases = {
        "q": (dict(q=inputs["q"].at[0, 3, 1, 5].set(jnp.nan)), (0, 3, 1)),
        "k": (dict(k_pages=inputs["k_pages"].at[page, row, 0, 5].set(jnp.nan)),
              (0, slice(2, None), slice(0, 4))),
        "v-inf": (dict(v_pages=inputs["v_pages"].at[page, row, 0, 5].set(jnp.inf)),
                  (0, slice(2, None), slice(0, 4))),
    }
    for where, (change, rows) in cases.items():
      reached = np.zeros(clean_out.shape[:3], bool)
      reached[rows] = True
      out, lse = run(dict(inputs, **change))
      lse = np.swapaxes(lse, 1, 2)
      if where == "v-inf":
        assert not np.isfinite(out[reached][:, 5]).any()
        np.testing.assert_array_equal(np.delete(out[reached], 5, axis=-1),
                                      np.delete(clean_out[reached], 5, axis=-1))
        np.testing.assert_array_equal(lse, clean_lse)
      else:
        assert np.isnan(out[reached]).all() and np.isnan(lse[reached]).all(), where
      np.testing.assert_array_equal(out[~reached], clean_out[~reached], err_msg=where)
      np.testing.assert_array_equal(lse[~reached], clean_lse[~reached], err_msg=where)

  def test_bad_page_ids_and_empty_rows(self, head_dim):
    """Inside jit a page id outside the pool reads zeros; an empty slot and
    padding rows give zeros and lse -inf."""
    inputs, keys, values = make_batch(14, [100, 40, 112, 0], [2, 1, 2, 0], page_size=16,
                                      head_dim=head_dim, dtype=jnp.bfloat16)
    table = np.asarray(inputs["page_table"]).copy()
    table[0, 2], table[1, 1] = 10_000, -7  # tokens 32-47 of sequence 0, 16-31 of 1
    keys, values = [x.copy() for x in keys], [x.copy() for x in values]
    for b, first in ((0, 32), (1, 16)):
      keys[b][first:first + 16] = values[b][first:first + 16] = 0
    inputs["page_table"] = jnp.asarray(table)
    got = run_paged(inputs, "flash", kv_split_size=64)
    assert_matches_float64(got, inputs, keys, values, jnp.bfloat16, "bad ids")
    assert np.all(got[0][3] == 0) and np.all(got[1][3] == -np.inf)
    assert np.all(got[0][1, 1:] == 0) and np.all(got[1][1, :, 1:] == -np.inf)
