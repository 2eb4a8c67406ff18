"""When GQA query heads are packed into one sequence (head_packing.py), and
that packing round-trips."""

import jax
import numpy as np
import pytest

from jax_flash import ffi, head_packing


def group(seq_q, diag_offset, window_left, window_right, heads_kv=2, seq_k=100):
  q = jax.ShapeDtypeStruct((2, seq_q, 8, 64), np.float32)
  k = jax.ShapeDtypeStruct((2, seq_k, heads_kv, 64), np.float32)
  call = ffi.KernelCall("gpu", 0.125, diag_offset, window_left, window_right)
  return head_packing.group(q, k, call)


@pytest.mark.parametrize("args,expected", [
    ((1, 99, -1, 0), 4),  # decoding, causal
    ((4, 96, -1, -1), 4),  # short, no mask
    ((4, 96, -1, 0), 1),  # causal: rows see different keys
    ((4, 96, -1, 3), 4),  # the window reaches the last key from every row
    ((1, 99, 50, 0), 1),  # a sliding window hides early keys
    ((1, 99, 99, 0), 4),  # ... unless it covers them all
    ((4, 96, -1, -1, 8), 1),  # no GQA group
    ((128, 0, -1, -1), 1),  # a full tile already
])
def test_group(args, expected):
  assert group(*args) == expected


def test_round_trips():
  rng = np.random.default_rng(0)
  rows = rng.normal(size=(2, 3, 8, 5))
  stats = rng.normal(size=(2, 8, 3))
  np.testing.assert_array_equal(head_packing.unpack_rows(head_packing.pack_rows(rows, 4), 4),
                                rows)
  np.testing.assert_array_equal(head_packing.unpack_stats(head_packing.pack_stats(stats, 4), 4),
                                stats)
  # Packed row t * 4 + g is query t of head g of kv head 0.
  np.testing.assert_array_equal(head_packing.pack_rows(rows, 4)[:, 2 * 4 + 1, 0], rows[:, 2, 1])
  np.testing.assert_array_equal(head_packing.pack_stats(stats, 4)[:, 1, 2 * 4 + 3],
                                stats[:, 7, 2])
