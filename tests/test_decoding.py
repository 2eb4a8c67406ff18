"""The short-query paths of the kernel calls: GQA query-head packing
(head_packing.py) and the split-KV forward (kv_split.py)."""

import jax
import numpy as np
import pytest

from jax_flash import ffi, head_packing, kv_split


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


def test_kv_split_parts():
  q = jax.ShapeDtypeStruct((2, 4, 2, 64), np.float32)  # packed: 2 kv heads
  k = jax.ShapeDtypeStruct((2, 4096, 2, 64), np.float32)
  gpu = ffi.KernelCall("gpu", 0.125, 0, -1, -1)
  assert kv_split.parts(q, k, gpu, has_segments=False) == 16  # 4 CTAs; 4096 // 256 keys
  # 32 CTAs: 4 chunks make one wave of configs' 132 CTAs (kv_split.py's measurements).
  batch8 = jax.ShapeDtypeStruct((8, 8, 4, 128), np.float32)
  long_k = jax.ShapeDtypeStruct((8, 16384, 4, 128), np.float32)
  assert kv_split.parts(batch8, long_k, gpu, has_segments=False) == 4
  mid = jax.ShapeDtypeStruct((2, 2048, 2, 64), np.float32)
  assert kv_split.parts(q, mid, gpu, has_segments=False) == 8  # 2048 // 256 keys
  short = jax.ShapeDtypeStruct((2, 512, 2, 64), np.float32)
  assert kv_split.parts(q, short, gpu, has_segments=False) == 1  # below MIN_KEYS_TO_SPLIT
  assert kv_split.parts(q, k, gpu, has_segments=True) == 1
  assert kv_split.parts(q, k, ffi.KernelCall("gpu", 0.125, 4092, -1, 0), False) == 1  # causal
  assert kv_split.parts(q, k, ffi.KernelCall("cpu", 0.125, 0, -1, -1), False) == 1
  odd = jax.ShapeDtypeStruct((2, 4099, 2, 64), np.float32)  # prime: no reshape into chunks
  assert kv_split.parts(q, odd, gpu, has_segments=False) == 1


@pytest.mark.parametrize("parts", [2, 8])
def test_kv_split_matches_whole_forward(parts):
  # Split on the CPU kernels (the GPU splits on its own): merged chunks give
  # the whole forward's output and lse.
  rng = np.random.default_rng(1)
  cpu = jax.devices("cpu")[0]
  q, k, v = (jax.device_put(rng.normal(size=shape).astype(np.float32), cpu)
             for shape in ((3, 5, 4, 32), (3, 512, 4, 32), (3, 512, 4, 32)))
  q_lens = jax.device_put(np.array([5, 5, 2], np.int32), cpu)
  kv_lens = jax.device_put(np.array([512, 77, 0], np.int32), cpu)
  call = ffi.KernelCall("cpu", 0.2, 0, -1, -1)
  empty = ffi.no_segments(q)
  want_out, want_lse = ffi._forward(q, k, v, q_lens, kv_lens, *empty, call)
  out, lse = kv_split.split_forward(ffi._forward, q, k, v, q_lens, kv_lens, empty, call, parts)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(out)[2] == 0) and np.all(np.isneginf(np.asarray(lse)[2]))
