"""Every caller mistake gets an error naming the argument, expected and got."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import jax_flash._configs
from jax_flash import _api as api, _ffi as ffi, _kernels as kernels, _plan as plan
from jax_flash import _reference as reference, _validation as validation
from jax_flash._call import KernelCall, Mask, MaskOperands, sink_operand

import numerics
from attention_base import run_attention


def _masks(q_lens, kv_lens, q_ids=None):
  """Lengths (and segment ids) as the kernels take them, batch first."""
  bounds = None if q_ids is None else (jnp.zeros((*q_ids.shape, 2), jnp.int32),) * 2
  return MaskOperands.build(q_lens.shape, q_lens, kv_lens, q_ids, q_ids, bounds)


def qkv(q_shape=(2, 16, 4, 64), k_shape=(2, 16, 2, 64), v_shape=None, dtype=jnp.float32):
  v_shape = k_shape if v_shape is None else v_shape
  return tuple(jnp.zeros(s, dtype) for s in (q_shape, k_shape, v_shape))


@pytest.mark.parametrize("shapes,match", [
    (((16, 4, 64), (2, 16, 2, 64)), r"q must have rank 4 \[batch, seq_q, heads_q, head_dim\], got shape \(16, 4, 64\)"),
    (((2, 16, 4, 64), (2, 16, 64)), r"k must have rank 4 .* got shape \(2, 16, 64\)"),
    (((2, 16, 4, 64), (3, 16, 2, 64)), r"batch size: expected 2, got k 3 and v 3"),
    (((2, 16, 4, 64), (2, 16, 2, 32)), r"k head_dim must equal q head_dim: expected 64, got 32"),
    (((2, 16, 4, 64), (2, 16, 3, 64)), r"heads_q must be a multiple of heads_kv: got heads_q=4, heads_kv=3"),
])
def test_bad_shapes(shapes, match):
  q, k, v = qkv(*shapes)
  with pytest.raises(ValueError, match=match):
    jax_flash.attention(q, k, v)


def test_value_shape_mismatch():
  q, k, v = qkv(v_shape=(2, 15, 2, 64))
  with pytest.raises(ValueError, match=r"v must match k in seq_k and heads_kv: expected \(16, 2\), got \(15, 2\)"):
    jax_flash.attention(q, k, v)


def test_mixed_dtypes():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="q, k and v must share one dtype, got q float32, k bfloat16"):
    jax_flash.attention(q, k.astype(jnp.bfloat16), v)


def test_integer_dtype():
  q, k, v = qkv(dtype=jnp.int32)
  with pytest.raises(ValueError, match="q must have a floating dtype, got int32"):
    jax_flash.attention(q, k, v)


@pytest.mark.parametrize("window,match", [
    ((-3, 2), r"window left size must be None or an int in \[0, 2\*\*31\), got -3"),
    ((1, 2, 3), r"window must be None, an int or a \(left, right\) pair, got \(1, 2, 3\)"),
    ((1.5, 2), r"window left size must be None or an int in \[0, 2\*\*31\), got 1.5"),
    ((2**31, 0), r"window left size must be None or an int in \[0, 2\*\*31\), got 2147483648"),
    ((4, True), r"window right size must be None or an int in \[0, 2\*\*31\), got True"),
    (True, r"window must be None, an int or a \(left, right\) pair, got True"),
])
def test_bad_window(window, match):
  with pytest.raises(ValueError, match=match):
    jax_flash.attention(*qkv(), window=window)


@pytest.mark.parametrize("lengths,match", [
    (jnp.array([3, 4, 5], jnp.int32), r"query_seq_lengths must have shape \(2,\), got \(3,\)"),
    (jnp.array([3.0, 4.0]), r"query_seq_lengths must have dtype int32, got float32"),
])
def test_bad_lengths(lengths, match):
  with pytest.raises(ValueError, match=match):
    jax_flash.attention(*qkv(), query_seq_lengths=lengths)


def test_bad_scale():
  with pytest.raises(ValueError, match="scale must be finite, got nan"):
    jax_flash.attention(*qkv(), scale=float("nan"))
  with pytest.raises(ValueError, match="scale must be None or a Python number, got ArrayImpl"):
    jax_flash.attention(*qkv(), scale=jnp.ones(3))


@pytest.mark.parametrize("softcap,match", [
    (-1.0, r"softcap must be None or a finite number > 0, got -1.0"),
    (0, r"softcap must be None or a finite number > 0, got 0.0"),
    (float("inf"), r"softcap must be None or a finite number > 0, got inf"),
    (jnp.ones(2), r"softcap must be None or a Python number, got ArrayImpl"),
    ("2", r"softcap must be None or a Python number, got str '2'"),
])
def test_bad_softcap(softcap, match):
  with pytest.raises(ValueError, match=match):
    jax_flash.attention(*qkv(), softcap=softcap)


def test_bad_deterministic():
  with pytest.raises(ValueError, match=r"deterministic must be a bool, got str 'yes'"):
    jax_flash.attention(*qkv(), deterministic="yes")


def test_handler_rejects_bad_options():
  """Options reaching the handler unchecked (a hand-built call) still fail cleanly."""
  cpu = jax.devices("cpu")[0]
  q, k, v = jax.device_put(qkv(), cpu)
  call = KernelCall(backend="cpu", scale=0.125, softcap=-2.0)
  lens = jax.device_put((jnp.full((2,), 16, jnp.int32),) * 2, cpu)
  with pytest.raises(Exception, match=r"jax_flash: softcap must be finite and >= 0"):
    jax.block_until_ready(kernels.forward(q, k, v, _masks(*lens), sink_operand(None, q), call))


@pytest.mark.gpu
@pytest.mark.parametrize("sinks,seq_k,match", [
    (jnp.zeros((2, 3, 1), jnp.float32), 16, r"jax_flash: sinks has 6 elements, expected 8"),
    (jnp.zeros((2, 4, 1), jnp.bfloat16), 16, r"jax_flash: sinks has the wrong element type"),
    # No keys: the sm80 kernel serves the call, and it adds no sinks.
    (jnp.zeros((2, 4, 1), jnp.float32), 0, r"jax_flash_fwd_sm80: takes no sinks"),
], ids=["shape", "dtype", "sm80"])
def test_gpu_handler_rejects_bad_sinks(sinks, seq_k, match):
  """Sinks the CUDA forward handler (v3) cannot use, hand-built past the
  Python plan, fail cleanly."""
  q = jnp.zeros((2, 16, 4, 64), jnp.bfloat16)
  k = v = jnp.zeros((2, seq_k, 2, 64), jnp.bfloat16)
  call = KernelCall(backend="gpu", scale=0.125)
  lens = (jnp.full((2,), 16, jnp.int32), jnp.full((2,), seq_k, jnp.int32))
  with pytest.raises(Exception, match=match):
    jax.block_until_ready(ffi.forward_kernel(q, k, v, _masks(*lens), sinks, call))


def test_unknown_implementation():
  with pytest.raises(ValueError, match=r"implementation must be one of .*, got 'triton'"):
    jax_flash.attention(*qkv(), implementation="triton")
  with pytest.raises(ValueError, match=r"implementation must be one of \(None, 'flash', 'xla', 'cudnn'\), got 'cpu'"):
    jax_flash.dot_product_attention(*qkv(), implementation="cpu")


def test_gpu_unsupported_head_dim():
  reason = jax_flash._configs.GPU.unsupported_reason(jnp.bfloat16, 40, 40)
  assert reason == "the gpu kernels support head_dim in (64, 96, 128, 192, 256), got 40"


def test_gpu_value_head_dim():
  gpu = jax_flash._configs.GPU
  assert gpu.unsupported_reason(jnp.bfloat16, 192, 128) is None
  assert gpu.value_padding(192, 128) == 64 and gpu.value_padding(128, 128) == 0
  assert jax_flash._configs.CPU.value_padding(192, 128) == 0
  reason = gpu.unsupported_reason(jnp.bfloat16, 128, 192)
  assert reason == "the gpu kernels need head_dim_v <= head_dim, got head_dim=128, head_dim_v=192"


# The plans ask the compiled library which Hopper variants exist.
needs_library = pytest.mark.skipif(not ffi.cuda_kernels_available(),
                                   reason="this installation holds no CUDA kernels")


@needs_library
def test_hopper_variants_are_the_librarys():
  """Which calls the Hopper kernels take, as the compiled library says
  (kernel_api.h: the has_variant queries)."""
  # DeepSeek's 192 / 128 has Hopper kernels of its own; other narrower V pad.
  forward = functools.partial(ffi.sm90_forward_has_variant, "bfloat16")
  assert forward(192, 128, False) and forward(192, 128, True) and not forward(256, 128, False)
  # The Hopper backward hands what it has no variant for to the sm80 kernels.
  backward = lambda dims=(128, 128), det=False, seg=False, cap=False: (
      ffi.sm90_backward_has_variant("bfloat16", *dims, det, seg, cap))
  assert backward() and backward(det=True) and backward(seg=True) and backward(cap=True)
  assert backward((192, 128)) and not backward((256, 128))
  assert not backward(det=True, seg=True)
  assert not backward(cap=True, det=True) and not backward(cap=True, seg=True)
  assert not ffi.sm90_backward_has_variant("float32", 128, 128, False, False, False)


@needs_library
def test_hopper_plans_take_narrow_values_unpadded(monkeypatch):
  monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: (9, 0))
  q, v = jnp.zeros((2, 200, 4, 192), jnp.bfloat16), jnp.zeros((2, 80, 2, 128), jnp.bfloat16)
  ids = jnp.zeros((2, 200), jnp.int32)
  call = KernelCall(backend="gpu", scale=0.1)
  padding = lambda call, ids=None, q=q: _backward_plan(q, v, ids, call).value_padding
  assert padding(call) == 0
  assert padding(call, ids) == 0
  # Deterministic packed documents run on the sm80 backward, which takes V as wide as Q.
  assert padding(dataclasses.replace(call, deterministic=True), ids) == 64
  wide = jnp.zeros((2, 200, 4, 256), jnp.bfloat16)
  assert padding(call, q=wide) == 128
  assert _backward_plan(wide, v, None, call).dq_tile_rows == ffi.sm90_dq_tile_rows(256, 256)
  k = jnp.zeros((2, 80, 2, 192), jnp.bfloat16)
  lens = jnp.zeros((2,), jnp.int32)
  forward = plan.plan_forward(q, k, v, _masks(lens, lens), call, sinks=False)
  assert forward.value_padding == 0
  monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: (8, 0))
  assert padding(call) == 64


@pytest.mark.gpu
def test_hopper_takes_narrow_values_unpadded():
  if (ffi.gpu_compute_capability() or (0,))[0] != 9:
    pytest.skip("the 192 / 128 kernels are Hopper's")
  q, k = (jnp.zeros((1, 64, 2, 192), jnp.bfloat16),) * 2
  v = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)
  attend = functools.partial(jax_flash.attention, implementation="gpu")
  assert "stablehlo.pad" not in jax.jit(attend).lower(q, k, v).as_text()
  grads = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=2))
  assert "stablehlo.pad" not in grads.lower(q, k, v).as_text()
  # Deterministic packed documents run on the sm80 backward, which takes V
  # as wide as Q: V and dout are padded for it.
  ids = jnp.zeros((1, 64), jnp.int32)
  attend = functools.partial(attend, segment_ids=ids, deterministic=True)
  grads = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum(), argnums=2))
  assert "stablehlo.pad" in grads.lower(q, k, v).as_text()


def _backward_plan(q, v, q_ids, call):
  """The plan of a backward call on q and v's shapes (k as wide as q)."""
  k = jnp.zeros((*v.shape[:-1], q.shape[-1]), q.dtype)
  lens = jnp.zeros(q.shape[:1], jnp.int32)
  return plan.plan_backward(q, k, v, _masks(lens, lens, q_ids), call)


@needs_library
def test_dq_chains_only_for_hopper_deterministic_kernels_without_a_mask(monkeypatch):
  q = jnp.zeros((2, 200, 4, 192), jnp.bfloat16)
  v = jnp.zeros((2, 80, 2, 128), jnp.bfloat16)
  ids = jnp.zeros((2, 200), jnp.int32)
  call = KernelCall(backend="gpu", scale=0.1, deterministic=True)
  chains = lambda call, ids=None: _backward_plan(q, v, ids, call).dq_chains
  monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: (9, 0))
  asked = []
  monkeypatch.setattr(ffi, "sm90_deterministic_dq_chains", lambda *dims: asked.append(dims) or 4)
  assert chains(call) == 4 and asked == [(192, 128, 80)]  # the kernel's count for these keys
  assert chains(call, ids) == 1  # the sm80 kernels serve it
  assert chains(dataclasses.replace(call, softcap=5.0)) == 1
  assert chains(call.with_mask(Mask(window_right=0))) == 1
  assert chains(call.with_mask(Mask(window_left=100))) == 1
  assert chains(dataclasses.replace(call, deterministic=False)) == 1
  assert chains(dataclasses.replace(call, backend="cpu")) == 1
  monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: (8, 0))
  assert chains(call) == 1


def test_dq_chains_default_to_one_without_the_kernels_query(monkeypatch):
  """A CUDA library without jax_flash_bwd_sm90_deterministic_dq_chains (no
  Hopper kernels, or built before the query) gets one accumulator."""
  monkeypatch.setattr(ffi, "_cuda_library", None)
  assert ffi.sm90_deterministic_dq_chains.__wrapped__(192, 128, 8192) == 1


def _replan(patch, **changes):
  """Makes every backward plan carry ``changes``."""
  planned = plan.plan_backward
  patch.setattr(plan, "plan_backward",
                lambda *args: dataclasses.replace(planned(*args), **changes))


def _cpu_backward_with_chains(chains, deterministic=True):
  cpu = jax.devices("cpu")[0]
  rng = np.random.default_rng(0)
  shapes = qkv(k_shape=(2, 16, 4, 64))  # no GQA: the call goes through unpacked
  q, k, v = (jax.device_put(rng.standard_normal(x.shape, np.float32), cpu) for x in shapes)
  call = KernelCall(backend="cpu", scale=0.125, deterministic=deterministic)
  lens = jax.device_put((jnp.full((2,), 16, jnp.int32),) * 2, cpu)
  out, lse = kernels.forward(q, k, v, _masks(*lens), sink_operand(None, q), call)
  delta = jnp.einsum("btnh,btnh->bnt", out, out)
  with pytest.MonkeyPatch.context() as patch:
    _replan(patch, dq_chains=chains)
    return jax.block_until_ready(
        kernels.backward(q, k, v, out, lse, delta, _masks(*lens), call))


def test_handler_takes_dq_chains_and_zeroes_all_but_the_first():
  """kernel_api.h: dq_accum may hold up to four accumulators in a
  deterministic backward; kernels that fill one zero the others, so the sum
  is dQ."""
  one = _cpu_backward_with_chains(1)
  for chains in (2, 4):
    for a, b in zip(one, _cpu_backward_with_chains(chains)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(Exception, match=r"dq_accum must have q's shape \(2, 16, 4, 64\), or that after "
                                      r"a leading 1 to 4, got \(5, 2, 16, 4, 64\)"):
    _cpu_backward_with_chains(5)
  with pytest.raises(Exception, match=r"dq_accum must have q's shape \(2, 16, 4, 64\), got "
                                      r"\(2, 2, 16, 4, 64\)"):
    _cpu_backward_with_chains(2, deterministic=False)


def _cpu_backward_in_tiles(rows):
  with pytest.MonkeyPatch.context() as patch:
    _replan(patch, dq_tile_rows=rows)
    return _cpu_backward_with_chains(1, deterministic=False)


def test_dq_accum_in_tiles_only_for_the_hopper_kernels_that_take_it():
  """kernel_api.h: dq_tile_rows; the CPU kernels write q's layout alone."""
  with pytest.raises(Exception, match=r"dq_accum must be in q's layout \(dq_tile_rows 0\), got "
                                      r"dq_tile_rows 64"):
    _cpu_backward_in_tiles(64)


@needs_library
def test_dq_tile_rows_follow_the_library_where_hopper_kernels_serve(monkeypatch):
  q, v = jnp.zeros((2, 64, 4, 256), jnp.bfloat16), jnp.zeros((2, 64, 2, 256), jnp.bfloat16)
  ids = jnp.zeros((2, 64), jnp.int32)
  call = KernelCall(backend="gpu", scale=0.1)
  rows = lambda call, q=q, v=v, ids=None: _backward_plan(q, v, ids, call).dq_tile_rows
  monkeypatch.setattr(ffi, "sm90_dq_tile_rows", lambda d, dv: 64 if d == 256 else 0)
  monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: (9, 0))
  assert rows(call) == 64
  assert rows(dataclasses.replace(call, deterministic=True)) == 64
  assert rows(call, ids=ids) == 64
  assert rows(call, q=q[..., :128], v=v[..., :128]) == 0
  assert rows(call, q=q.astype(jnp.float32)) == 0
  assert rows(dataclasses.replace(call, deterministic=True), ids=ids) == 0  # sm80 serves
  assert rows(dataclasses.replace(call, softcap=5.0, deterministic=True)) == 0
  assert rows(dataclasses.replace(call, backend="cpu")) == 0
  monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: (8, 0))
  assert rows(call) == 0


@pytest.mark.parametrize("head_dim", [96, 192, 256])
def test_dq_from_tiles_reads_the_hopper_fragment_order(head_dim):
  """cuda_src/bwd_sm90/wgmma_views.py, store_dq_fragments: within a (WG,
  warp) block, value pair p = h + 2 j of lane l at 64 p + 2 l holds row 16
  warp + 8 h + l / 4, columns WG head_dim / 2 + 8 j + 2 (l % 4) and one more."""
  rng = np.random.default_rng(head_dim)
  seq, heads = 100, 3
  dq = rng.standard_normal((2, 1, 2, seq, heads, head_dim)).astype(np.float32)  # batch.., chains
  tiles = -(-seq // 64)
  padded = np.zeros((2, 1, 2, tiles * 64, heads, head_dim), np.float32)
  padded[:, :, :, :seq] = dq
  wg, warp, pair, lane, e = np.meshgrid(np.arange(2), np.arange(4), np.arange(head_dim // 8),
                                        np.arange(32), np.arange(2), indexing="ij")
  offset = ((wg * 4 + warp) * (head_dim // 8) + pair) * 64 + lane * 2 + e
  row = 16 * warp + 8 * (pair % 2) + lane // 4
  col = wg * head_dim // 2 + 8 * (pair // 2) + 2 * (lane % 4) + e
  blocks = np.zeros((2, 1, 2, heads, tiles, 64 * head_dim), np.float32)
  for t in range(tiles):
    tile = padded[:, :, :, t * 64:(t + 1) * 64].transpose(0, 1, 2, 4, 3, 5)  # .., heads, 64, dim
    blocks[..., t, offset.ravel()] = tile[..., row.ravel(), col.ravel()]
  tiled = jnp.asarray(blocks.reshape(2, 1, 2, heads, tiles, 64, head_dim))
  np.testing.assert_array_equal(np.asarray(kernels._dq_from_tiles(tiled, seq)), dq)


@pytest.mark.gpu
def test_hopper_deterministic_backward_takes_two_dq_accumulators():
  if (ffi.gpu_compute_capability() or (0,))[0] != 9:
    pytest.skip("the two-chain deterministic kernels are Hopper's")
  q = k = jnp.zeros((1, 64, 2, 192), jnp.bfloat16)
  v = jnp.zeros((1, 64, 2, 128), jnp.bfloat16)

  def accumulators(**kw):
    attend = functools.partial(jax_flash.attention, implementation="gpu", **kw)
    grads = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum()))
    # The leading chains of dq_accum, in q's layout or in query tiles.
    layouts = r"f32\[(?:(\d+),)?1,64,2,192\]|f32\[1,(\d+),2,1,64,192\]"
    found = ["".join(m) for m in re.findall(layouts, grads.lower(q, k, v).compile().as_text())]
    assert found, "no dq_accum of either layout in the compiled backward"
    return found

  assert "2" in accumulators(deterministic=True) and "2" not in accumulators()
  assert "2" not in accumulators(deterministic=True, segment_ids=jnp.zeros((1, 64), jnp.int32))
  assert "2" not in accumulators(deterministic=True, causal=True)


@pytest.mark.gpu
@pytest.mark.parametrize("chains", [2, 4])
def test_hopper_deterministic_backward_with_other_accumulator_counts(monkeypatch, chains):
  """dq_accum sized for other keys (a module serialized on another GPU):
  at 9000 keys, three groups of KV tiles on 132 SMs, the kernel keeps the
  unrotated order with two accumulators and rotates with four."""
  if (ffi.gpu_compute_capability() or (0,))[0] != 9:
    pytest.skip("the dQ chains are the Hopper deterministic kernels'")
  q, k, v, dout = numerics.random_qkv(3, 2, 70, 9000, 2, 1, 192, jnp.bfloat16, 128)
  attend = functools.partial(run_attention, q, k, v, dout, "gpu", deterministic=True)
  expected = attend()
  monkeypatch.setattr(ffi, "sm90_deterministic_dq_chains", lambda *_: chains)
  for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), attend(), expected):
    np.testing.assert_allclose(a, b, rtol=0.02, atol=0.02, err_msg=name)


@pytest.mark.gpu
def test_hopper_backward_takes_dq_in_tiles_where_its_kernels_write_them():
  if (ffi.gpu_compute_capability() or (0,))[0] != 9:
    pytest.skip("dQ in tiles is the Hopper kernels'")

  def accumulator_types(head_dim, **kw):
    q = k = v = jnp.zeros((1, 100, 2, head_dim), jnp.bfloat16)
    attend = functools.partial(jax_flash.attention, implementation="gpu", **kw)
    grads = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).sum()))
    return grads.lower(q, k, v).as_text()

  # [batch, chains, heads, tiles, rows, head_dim]; dQ^T (80 rows at hd128) in q's layout.
  assert "tensor<1x1x2x2x64x256xf32>" in accumulator_types(256)
  assert "tensor<1x1x2x2x64x256xf32>" in accumulator_types(256, deterministic=True)
  assert "tensor<1x100x2x128xf32>" in accumulator_types(128)
  assert "x64x256xf32>" not in accumulator_types(256, softcap=5.0, deterministic=True)  # the sm80 kernels


@pytest.mark.gpu
def test_hopper_backward_still_takes_dq_in_q_layout(monkeypatch):
  """A module serialized before the Hopper kernels took dQ in tiles passes
  q's layout, which the sm80 kernels then serve (cuda_handlers.cc)."""
  if (ffi.gpu_compute_capability() or (0,))[0] != 9:
    pytest.skip("dQ in tiles is the Hopper kernels'")
  q, k, v = (jax.random.normal(key, (2, 100, 2, 256), jnp.bfloat16)
             for key in jax.random.split(jax.random.key(0), 3))
  loss = lambda q, k, v: jnp.sum(jax_flash.attention(q, k, v, implementation="gpu").astype(jnp.float32))
  in_tiles = jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)
  _replan(monkeypatch, dq_tile_rows=0)
  in_q_layout = jax.jit(jax.grad(lambda *x: loss(*x), (0, 1, 2)))(q, k, v)
  for a, b in zip(in_tiles, in_q_layout):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=0.03, atol=0.03)


def test_forcing_gpu_without_gpu_raises():
  reason = api._gpu_unavailable_reason()
  if reason is None:
    pytest.skip("a usable GPU is present")
  with pytest.raises(NotImplementedError, match=re.escape(f"implementation='gpu': {reason}")):
    jax_flash.attention(*qkv(dtype=jnp.bfloat16), implementation="gpu")


def test_gpu_dtype_unsupported():
  reason = jax_flash._configs.GPU.unsupported_reason(jnp.float32, 64, 64)
  assert reason == "the gpu kernels support dtypes float16, bfloat16, got float32"


def test_flash_without_kernels_for_the_case_raises():
  # float64 is valid input that no kernel serves.
  with jax.enable_x64(True):
    q, k, v = qkv(dtype=jnp.float64)
    with pytest.raises(NotImplementedError,
                       match=r"implementation='flash': the (cpu|gpu) kernels support dtypes .*got float64"):
      jax_flash.attention(q, k, v, implementation="flash")
    # The default falls back to XLA instead.
    assert jax_flash.attention(q, k, v).dtype == jnp.float64


def test_cpu_head_dim_limit():
  q, k, v = qkv((1, 4, 1, 520), (1, 4, 1, 520))
  with pytest.raises(NotImplementedError, match=r"head_dim <= 512, got 520"):
    jax_flash.attention(q, k, v, implementation="cpu")


def test_dot_product_attention_flash_rejects_bias_and_mask():
  q, k, v = qkv(k_shape=(2, 16, 4, 64))
  with pytest.raises(NotImplementedError, match="implementation='flash' does not support bias"):
    jax_flash.dot_product_attention(q, k, v, bias=jnp.zeros((2, 4, 16, 16)), implementation="flash")
  with pytest.raises(NotImplementedError, match="implementation='flash' does not support mask"):
    jax_flash.dot_product_attention(q, k, v, mask=jnp.ones((2, 4, 16, 16), bool),
                                    implementation="flash")


def test_dot_product_attention_value_head_dim():
  q, k, v = qkv(k_shape=(2, 16, 4, 64), v_shape=(2, 16, 4, 32))
  with pytest.raises(ValueError, match=r"value must have the key's shape \(2, 16, 4, 64\), got \(2, 16, 4, 32\)"):
    jax_flash.dot_product_attention(q, k, v)


@pytest.mark.parametrize("shape", [(0, 16, 4, 64), (2, 0, 4, 64)])
def test_empty_batch_or_queries(shape):
  q, k, v = qkv(q_shape=shape, k_shape=(shape[0], 16, 2, 64))
  out = jax_flash.attention(q, k, v)
  assert out.shape == shape


def test_empty_keys_give_zero_output_and_finite_gradients():
  q, k, v = qkv(q_shape=(2, 5, 4, 64), k_shape=(2, 0, 2, 64))
  q = q + 1.0
  out, lse = jax_flash.attention(q, k, v, return_lse=True)
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
  grad = jax.grad(lambda q: jnp.sum(jax_flash.attention(q, k, v)))(q)
  assert np.all(np.asarray(grad) == 0)


def test_handler_rejects_inconsistent_buffers():
  """The C++ handler validates again and returns an error, never aborts."""
  cpu = jax.devices("cpu")[0]
  q, k, v = jax.device_put(qkv(), cpu)
  call = KernelCall(backend="cpu", scale=0.125)
  lens = jax.device_put((jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32)), cpu)
  with pytest.raises(Exception, match=r"jax_flash: q_lens has 3 elements, expected 2"):
    jax.block_until_ready(kernels.forward(q, k, v, _masks(*lens), sink_operand(None, q), call))


@pytest.mark.parametrize("segment_ids,match", [
    (jnp.zeros((2, 15), jnp.int32), r"q_segment_ids must have shape \(2, 16\), got \(2, 15\)"),
    (jnp.zeros((2, 16), jnp.float32), r"q_segment_ids must have dtype int32, got float32"),
    ((jnp.zeros((2, 16), jnp.int32), jnp.zeros((2, 9), jnp.int32)),
     r"kv_segment_ids must have shape \(2, 16\), got \(2, 9\)"),
    ((jnp.zeros((2, 16), jnp.int32),) * 3,
     r"segment_ids must be one \[batch, seq\] array or a \(q_segment_ids, kv_segment_ids\) pair, "
     r"got a sequence of 3"),
])
def test_bad_segment_ids(segment_ids, match):
  with pytest.raises(ValueError, match=match):
    jax_flash.attention(*qkv(), segment_ids=segment_ids)


def test_one_segment_array_needs_equal_lengths():
  q, k, v = qkv(q_shape=(2, 8, 4, 64))
  with pytest.raises(ValueError, match="one segment_ids array needs seq_q == seq_k; .* got "
                                       "seq_q=8, seq_k=16"):
    jax_flash.attention(q, k, v, segment_ids=jnp.zeros((2, 8), jnp.int32))


@pytest.mark.parametrize("offsets,match", [
    ([0, 5, 3], r"cu_seqlens_q must start at 0, never decrease and end at most at the 10 packed "
                r"tokens, got \[0, 5, 3\]"),
    ([1, 5], r"must start at 0.* got \[1, 5\]"),
    ([0, 11], r"end at most at the 10 packed tokens, got \[0, 11\]"),
    ([0], r"cu_seqlens_q must have shape \(num_docs \+ 1,\) with num_docs >= 1, got \(1,\)"),
])
def test_bad_varlen_offsets(offsets, match):
  q = jnp.zeros((10, 4, 64))
  with pytest.raises(ValueError, match=match):
    jax_flash.varlen_attention(q, q, q, jnp.array(offsets, jnp.int32))


def test_varlen_rank_and_causal_cross_documents():
  q = jnp.zeros((10, 4, 64))
  with pytest.raises(ValueError, match=r"q must have rank 3 \[total_tokens, heads, head_dim\], "
                                       r"got shape \(1, 10, 4, 64\)"):
    jax_flash.varlen_attention(q[None], q, q, jnp.array([0, 10], jnp.int32))
  offsets = jnp.array([0, 4, 10], jnp.int32)
  with pytest.raises(NotImplementedError, match="causal or windowed varlen attention needs the "
                                                "documents of q and k to coincide"):
    jax_flash.varlen_attention(q, q, q, offsets, offsets, causal=True)


@pytest.mark.parametrize("chains", [1, 2])
def test_deterministic_dq_keeps_only_the_tiles_a_turn_wrote(chains):
  """kernels._written_tiles_only: Hopper's deterministic backward does not zero
  dq_accum, so a query tile whose dq_semaphore count (entry tile x chains +
  chain) is 0 must read as zeros, whatever the buffer held."""
  rng = np.random.default_rng(chains)
  batch, seq, heads, dim, tile = 2, 100, 3, 8, 32  # tiles of 32 rows: 4, the last partial
  garbage = rng.standard_normal((chains, batch, seq, heads, dim)).astype(np.float32)
  tiles = -(-seq // tile)
  turns = rng.integers(0, 3, (batch, heads, chains * -(-seq // 32))).astype(np.int32)
  turns[0, 1, :] = 0  # a head that no KV tile reached
  dq = garbage if chains > 1 else garbage[0]
  kept = np.asarray(kernels._written_tiles_only(jnp.asarray(dq), jnp.asarray(turns), tile, chains))
  for c in range(chains):
    for b in range(batch):
      for h in range(heads):
        for t in range(tiles):
          rows = slice(t * tile, (t + 1) * tile)
          got = (kept[c] if chains > 1 else kept)[b, rows, h]
          want = garbage[c, b, rows, h] if turns[b, h, t * chains + c] > 0 else 0.0
          np.testing.assert_array_equal(got, want)


# Strict types for flags and static parameters (a string or a bool is not a
# number, a string is not a flag).

@pytest.mark.parametrize("flag", ["causal", "return_lse"])
def test_flags_must_be_bools(flag):
  with pytest.raises(ValueError, match=rf"{flag} must be a bool, got str 'no'"):
    jax_flash.attention(*qkv(), **{flag: "no"})


def test_dot_product_attention_flags_must_be_bools():
  with pytest.raises(ValueError, match=r"is_causal must be a bool, got int 1"):
    jax_flash.dot_product_attention(*qkv(k_shape=(2, 16, 4, 64)), is_causal=1)


def test_varlen_causal_must_be_a_bool():
  q = jnp.zeros((10, 4, 64))
  with pytest.raises(ValueError, match=r"causal must be a bool, got str 'no'"):
    jax_flash.varlen_attention(q, q, q, jnp.array([0, 10], jnp.int32), causal="no")


def test_scale_must_be_a_number_not_a_string():
  with pytest.raises(ValueError, match=r"scale must be None or a Python number, got str '0.5'"):
    jax_flash.attention(*qkv(), scale="0.5")


def test_traced_scale_is_a_clear_error_in_attention():
  q, k, v = qkv()
  attend = jax.jit(lambda q, k, v, s: jax_flash.attention(q, k, v, scale=s))
  with pytest.raises(ValueError, match=r"scale must be None or a Python number, got a traced "
                                       r"value \(it is a static kernel parameter"):
    attend(q, k, v, 0.5)


def test_numpy_integers_and_scalars_are_accepted():
  q, k, v, _ = numerics.random_qkv(0, 1, 20, 20, 2, 2, 16, jnp.float32)
  want = jax_flash.attention(q, k, v, window=2, scale=0.5)
  got = jax_flash.attention(q, k, v, window=np.int64(2), scale=np.float32(0.5))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  got = jax_flash.attention(q, k, v, window=(np.int32(2), np.int64(2)), scale=jnp.float32(0.5))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# Shapes and dtypes no kernel, or no int32 index, can serve.

def test_head_dim_zero():
  with pytest.raises(ValueError, match=r"head_dim must be at least 1, got 0"):
    jax_flash.attention(*qkv((2, 16, 4, 0), (2, 16, 2, 0)))


def test_sequence_past_int32():
  q = jax.ShapeDtypeStruct((1, 2**31, 1, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((1, 16, 1, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"seq_q must be below 2\*\*31 \(the kernels index with "
                                       r"int32\), got 2147483648"):
    jax.eval_shape(jax_flash.attention, q, k, k)


def test_lengths_past_int32():
  with pytest.raises(ValueError, match=r"key_value_seq_lengths must hold int32 values \(below "
                                       r"2\*\*31\), got \[2147483648, 3\]"):
    jax_flash.attention(*qkv(), key_value_seq_lengths=[2**31, 3])


def test_float8_inputs():
  q, k, v = qkv(dtype=jnp.float8_e4m3fn)
  with pytest.raises(NotImplementedError, match=r"jax_flash takes float16, bfloat16, float32, "
                                                r"float64 inputs, got q float8_e4m3fn"):
    jax_flash.attention(q, k, v)


def test_symbolic_shapes_in_export():
  from jax import export
  batch, seq = export.symbolic_shape("b, t")
  q = jax.ShapeDtypeStruct((batch, seq, 4, 64), jnp.float32)
  k = jax.ShapeDtypeStruct((batch, seq, 2, 64), jnp.float32)
  with pytest.raises(NotImplementedError, match=r"jax_flash needs static shapes .* got q shape "
                                                r"\(b, t, 4, 64\) with symbolic dimensions"):
    export.export(jax.jit(jax_flash.attention), platforms=["cpu"])(q, k, k)


# Second-order gradients.

def test_second_order_gradients_of_the_kernels():
  q, k, v, _ = numerics.random_qkv(1, 1, 16, 16, 2, 2, 16, jnp.float32)
  loss = lambda q: jnp.sum(jax_flash.attention(q, k, v, implementation="cpu") ** 2)
  with pytest.raises(NotImplementedError, match="second-order gradients"):
    jax.grad(lambda q: jnp.sum(jax.grad(loss)(q)))(q)
  with pytest.raises(NotImplementedError, match="second-order gradients"):
    jax.hessian(loss)(q)


def test_second_order_gradients_of_xla():
  """implementation='xla' differentiates its backward like any JAX code."""
  q, k, v, _ = numerics.random_qkv(1, 1, 12, 12, 2, 2, 8, jnp.float32)
  mask = dict(scale=0.3, diag_offset=0, window_left=-1, window_right=0)
  attend = lambda q: jax_flash.attention(q, k, v, causal=True, scale=0.3, implementation="xla")
  plain = lambda q: reference.attention_reference(q, k, v, **mask)[0]
  second = lambda f: jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(jax.grad(
      lambda q: jnp.sum(f(q) ** 2))(q)))))(q)
  # float32 products on GPUs too: with TF32 the two orders of the same sums
  # differed by 5e-3 relative (H200).
  with jax.default_matmul_precision("float32"):
    np.testing.assert_allclose(np.asarray(second(attend)), np.asarray(second(plain)),
                               rtol=1e-4, atol=1e-5)


# jax.nn's drop-in takes a traced scale, as jax.nn does.

def test_dot_product_attention_traced_scale():
  q, k, v, _ = numerics.random_qkv(2, 2, 20, 20, 4, 4, 16, jnp.float32)
  ours = jax.jit(lambda s: jax_flash.dot_product_attention(q, k, v, scale=s, is_causal=True))
  theirs = jax.jit(lambda s: jax.nn.dot_product_attention(q, k, v, scale=s, is_causal=True))
  np.testing.assert_allclose(np.asarray(ours(0.3)), np.asarray(theirs(0.3)), rtol=1e-6, atol=1e-6)
  flash = jax.jit(lambda s: jax_flash.dot_product_attention(q, k, v, scale=s,
                                                            implementation="flash"))
  with pytest.raises(NotImplementedError, match="implementation='flash' does not support a "
                                                "traced scale"):
    flash(0.3)
