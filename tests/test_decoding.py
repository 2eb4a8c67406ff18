"""The short-query paths of the kernel calls: GQA query-head packing
(head_packing.py) and the split-KV forward (kv_split.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import numerics
from jax_flash import _ffi as ffi
from jax_flash import _gpu_support as gpu_support
from jax_flash import _head_packing as head_packing
from jax_flash import _kv_split as kv_split
from jax_flash import _paged as paged
from jax_flash._call import KernelCall, Mask, MaskOperands, sink_operand


def group(seq_q, diag_offset, window_left, window_right, heads_kv=2, seq_k=100):
  q = jax.ShapeDtypeStruct((2, seq_q, 8, 64), np.float32)
  k = jax.ShapeDtypeStruct((2, seq_k, heads_kv, 64), np.float32)
  call = KernelCall("gpu", 0.125, Mask(diag_offset, window_left, window_right))
  return head_packing.group(q.shape, k.shape, call)


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
  q = (2, 4, 2, 64)  # packed: 2 kv heads
  k = (2, 4096, 2, 64)
  gpu = KernelCall("gpu", 0.125)
  # One wave of an H100's 132 SMs (kv_split.py's measurements).
  parts = functools.partial(kv_split.parts, target_ctas=132)
  assert parts(q, k, gpu, has_segments=False) == 16  # 4 CTAs; 4096 // 256 keys
  # 32 CTAs: 4 chunks make one wave.
  assert parts((8, 8, 4, 128), (8, 16384, 4, 128), gpu, has_segments=False) == 4
  assert parts(q, (2, 2048, 2, 64), gpu, has_segments=False) == 8  # 2048 // 256 keys
  assert parts(q, (2, 512, 2, 64), gpu, has_segments=False) == 1  # below MIN_KEYS_TO_SPLIT
  assert parts(q, k, gpu, has_segments=True) == 1
  assert parts(q, k, KernelCall("gpu", 0.125, Mask(4092, -1, 0)), has_segments=False) == 1  # causal
  assert parts(q, k, gpu, has_segments=False, target_ctas=0) == 1  # the CPU's: never
  odd = (2, 4099, 2, 64)  # prime: no reshape into chunks
  assert parts(q, odd, gpu, has_segments=False) == 1


def test_split_target_is_the_devices_sm_count():
  """A split aims at one wave of the GPU it runs on; lowering for CUDA
  without one, at an H100's (132 SMs). The CPU kernels never split."""
  gpus = jax.devices("gpu") if jax.default_backend() == "gpu" else []
  sms = gpus[0].core_count if gpus else 132
  assert gpu_support.split_target("gpu") == sms
  assert gpu_support.split_target("cpu") == 0


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
  call = KernelCall("cpu", 0.2)
  masks = MaskOperands.build((3,), q_lens, kv_lens)
  want_out, want_lse = ffi.forward_kernel(q, k, v, masks, sink_operand(None, q), call)
  out, lse = kv_split.split_forward(ffi.forward_kernel, q, k, v, masks, call, parts)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lse, want_lse, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(out)[2] == 0) and np.all(np.isneginf(np.asarray(lse)[2]))


def test_fixed_split_routing(monkeypatch):
  # Which calls take the batch-invariant path: decided by one sequence's
  # shape, never by the batch (below the grid's limit).
  monkeypatch.setattr(paged, "_CUDA_REGISTERED", True)
  gpu = KernelCall("gpu", 0.1, batch_invariant=True)

  def applies(batch=2, rows=4, seq_k=4096, head_dim=128, dtype=jnp.bfloat16, call=gpu,
              hopper=True, has_segments=False):
    q, k = (batch, rows, 2, head_dim), (batch, seq_k, 2, head_dim)
    return kv_split.fixed_split_applies(q, k, head_dim, dtype, call, has_segments=has_segments,
                                        hopper=hopper)

  assert applies() and applies(batch=1) and applies(batch=512) and applies(seq_k=16)
  assert applies(batch=65535 // 2, seq_k=8192) and not applies(batch=65535 // 2 + 1, seq_k=8192)
  assert not applies(hopper=False)
  assert not applies(seq_k=4100)  # not a whole number of 16-token pages
  assert not applies(rows=128)  # a prefill tile: no split
  assert not applies(head_dim=96) and not applies(dtype=jnp.float32)
  assert not applies(has_segments=True)
  assert not applies(call=KernelCall("gpu", 0.1, Mask(4092, -1, 0), batch_invariant=True))
  assert not applies(call=KernelCall("cpu", 0.1, batch_invariant=True))
  assert not applies(call=KernelCall("gpu", 0.1))  # not asked for
  # Asked for, the grid split is off everywhere.
  assert kv_split.parts((1, 4, 2, 64), (1, 4096, 2, 64), gpu, has_segments=False,
                        target_ctas=132) == 1


def test_batch_invariant_on_cpu_and_its_errors():
  # The CPU kernels never split: a row's output is the same in any batch. Pinned to the CPU so
  # that a GPU machine runs it there too (no GPU kernel serves float32).
  with jax.default_device(jax.devices("cpu")[0]):
    _check_batch_invariant_on_cpu()


def _check_batch_invariant_on_cpu():
  q, k, v, lens = _decode_inputs(7, [300, 5, 1000], 1024, heads=(8, 2), head_dim=64,
                                 dtype=jnp.float32)
  full = _decode(q, k, v, lens, None, batch_invariant=True)
  alone = _decode(q[2:], k[2:, :1000], v[2:, :1000], lens[2:], None, batch_invariant=True)
  for f, a in zip(full, alone):
    np.testing.assert_array_equal(f[2:], a)
  with pytest.raises(NotImplementedError, match="batch_invariant=True needs jax_flash's kernels"):
    _decode(q, k, v, lens, "xla", batch_invariant=True)
  with pytest.raises(NotImplementedError, match="batch_invariant=True needs jax_flash's kernels"):
    wide = jnp.zeros((3, 1, 8, 520), jnp.float32)  # past the CPU kernels' 512
    _decode(wide, wide[:, :, :2], wide[:, :, :2], lens, None, batch_invariant=True)
  with pytest.raises(ValueError, match="batch_invariant"):
    _decode(q, k, v, lens, None, batch_invariant="yes")


def _hopper_paged_reason():
  if jax.default_backend() != "gpu":
    return "no CUDA GPU visible to JAX"
  if (ffi.gpu_compute_capability() or (0,))[0] != 9 or not paged._CUDA_REGISTERED:
    return "needs a Hopper GPU and the paged kernel"
  return None


def _decode_inputs(seed, lengths, capacity, *, seq_q=1, heads=(32, 8), head_dim=128,
                   dtype=jnp.bfloat16):
  keys = jax.random.split(jax.random.key(seed), 3)
  batch = len(lengths)
  q = jax.random.normal(keys[0], (batch, seq_q, heads[0], head_dim), dtype)
  k = jax.random.normal(keys[1], (batch, capacity, heads[1], head_dim), dtype)
  v = jax.random.normal(keys[2], (batch, capacity, heads[1], head_dim), dtype)
  return q, k, v, jnp.asarray(lengths, jnp.int32)


def _decode(q, k, v, lengths, implementation="flash", **kwargs):
  return jax_flash.attention(q, k, v, causal=True, key_value_seq_lengths=lengths,
                             return_lse=True, implementation=implementation, **kwargs)


_invariant = functools.partial(_decode, batch_invariant=True)


@pytest.mark.gpu
@pytest.mark.skipif(_hopper_paged_reason() is not None, reason=str(_hopper_paged_reason()))
class TestInvariantDecodeGpu:

  @pytest.mark.parametrize("seq_q,heads,dim,kind", [
      (1, (32, 8), 128, jnp.bfloat16), (1, (8, 8), 64, jnp.float16),
      (3, (16, 2), 256, jnp.bfloat16), (1, (8, 1), 128, jnp.float16)])
  def test_matches_reference(self, seq_q, heads, dim, kind):
    lengths = [1, 17, 1000, 4097, 0, 8192]
    q, k, v, lens = _decode_inputs(3, lengths, 8192, seq_q=seq_q, heads=heads, head_dim=dim,
                                   dtype=kind)
    got = _invariant(q, k, v, lens, softcap=20.0)
    ref = _decode(*(x.astype(jnp.float32) for x in (q, k, v)), lens, "xla", softcap=20.0)
    naive = _decode(q, k, v, lens, "xla", softcap=20.0)
    for name, g, r, n in zip(("out", "lse"), got, ref, naive):
      numerics.assert_within_tolerance(name, g, r, n, kind, reduction=8192)

  def test_batch_invariant(self):
    """One sequence's output, bitwise: alone, in another slot of a larger
    batch beside other lengths, and in a longer cache buffer."""
    length = 5000
    q, k, v, lens = _decode_inputs(4, [length], 8192)
    alone = _invariant(q, k, v, lens)
    others_q, others_k, others_v, _ = _decode_inputs(5, [1] * 6, 16384)
    slot = 4
    mixed = _invariant(others_q.at[slot].set(q[0]), others_k.at[slot, :8192].set(k[0]),
                    others_v.at[slot, :8192].set(v[0]),
                    jnp.asarray([70, 16384, 3, 9000, length, 1], jnp.int32))
    for a, m in zip(alone, mixed):
      np.testing.assert_array_equal(m[slot], a[0])

  def test_equals_paged_attention(self):
    # The same cache as 16-token pages: bitwise the same (same kernel, splits).
    q, k, v, lens = _decode_inputs(6, [4097, 12, 8192], 8192, seq_q=2)
    out, lse = jax_flash.attention(q, k, v, key_value_seq_lengths=lens, return_lse=True,
                                   batch_invariant=True, implementation="flash")
    pages = lambda x: x.reshape(-1, 16, *x.shape[2:])
    table = jnp.arange(3 * 512, dtype=jnp.int32).reshape(3, 512)
    paged_out, paged_lse = jax_flash.paged_attention(q, pages(k), pages(v), table, lens,
                                                     causal=False, return_lse=True,
                                                     implementation="flash")
    np.testing.assert_array_equal(out, paged_out)
    np.testing.assert_array_equal(lse, paged_lse)
