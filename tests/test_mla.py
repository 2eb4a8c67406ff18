"""jax_flash.mla_decode on both latent cache formats (bfloat16 and the FP8
RoPE-aware per-token format): the maths against float64 references in
numpy, the FP8 scheme's pieces, page placement, poisoned unused slots, batch
invariance, tensor-parallel heads, the cache writes and the errors.

The module-level checks run the XLA composition; mla_kernel_checks.py holds
the kernels' checks through the same helpers with implementation="flash",
run on the Hopper kernels (test_mla_gpu.py, both formats; skipped without a
Hopper GPU) and on the CPU kernel (test_mla_cpu.py, both formats)."""

import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_flash
import numerics
from jax_flash import _mla as mla, _mla_fp8 as mla_fp8

PAGE = mla_fp8.PAGE_SIZE
LATENT, WIDTH = mla_fp8.LATENT_DIM, mla_fp8.HEAD_DIM
E4M3 = ml_dtypes.float8_e4m3fn
SCALE = 192 ** -0.5  # DeepSeek-V2/V3's softmax scale without YaRN
# The FP8 output's error against the float64 attention over the unquantised
# bfloat16 cache, relative to the output's magnitude, on Gaussian inputs
# like this file's: benchmarks/mla_accuracy.py measured at most 0.080 (largest
# error over largest magnitude) and 0.056 (RMS over RMS) at 1000 and 4096
# keys (the "gaussian" rows of benchmarks/results/cpu-2026-11-28-mla-accuracy.json).
# The tests allow twice that.
FP8_MAX_ERROR, FP8_RMS_ERROR = 0.16, 0.11


def numpy_quantize(x):
  """mla_fp8.quantize_rows in numpy (ml_dtypes): rows over the last axis."""
  x = np.asarray(x, np.float32)
  amax = np.max(np.abs(x), axis=-1)
  with np.errstate(invalid="ignore", divide="ignore"):
    scales = np.where(amax > 0, np.maximum(amax * np.float32(1 / 448), mla_fp8.MIN_SCALE), 1)
    codes = np.clip(x * (np.float32(1) / scales)[..., None], -448, 448).astype(E4M3)
  return codes, scales


def numpy_dequantize(rows):
  """Float32 rows as the FP8 format stores them (query or cache)."""
  codes, scales = numpy_quantize(rows[..., :LATENT])
  rope = np.asarray(rows[..., LATENT:], np.float32).astype(ml_dtypes.bfloat16)
  return np.concatenate([codes.astype(np.float32) * scales[..., None],
                         rope.astype(np.float32)], axis=-1)


def make_batch(seed, cache_lengths, query_lengths, *, heads=16, fp8=False,
               dtype=jnp.bfloat16, max_pages=None, spare_pages=3):
  """A ragged batch in a shuffled page pool whose unused slots and pages
  hold NaN and Inf, padding query rows NaN. Returns (inputs of mla_decode,
  per-sequence latent rows [n, 576] as float32 before any FP8 quantisation)."""
  rng = np.random.default_rng(seed)
  batch = len(cache_lengths)
  pages_of = [-(-n // PAGE) for n in cache_lengths]
  max_pages = max_pages or max(max(pages_of), 1)
  num_pages = sum(pages_of) + spare_pages
  order = rng.permutation(num_pages)
  table = np.full((batch, max_pages), -1, np.int32)
  poison = np.where(rng.random((num_pages, PAGE, WIDTH)) < 0.5, np.nan, np.inf)
  pool = poison.astype(np.float32)
  rows, used = [], 0
  for b, n in enumerate(cache_lengths):
    table[b, :pages_of[b]] = order[used:used + pages_of[b]]
    used += pages_of[b]
    x = rng.standard_normal((n, WIDTH)).astype(dtype).astype(np.float32)
    token = np.arange(n)
    pool[table[b, token // PAGE], token % PAGE] = x
    rows.append(x)
  max_new = max(max(query_lengths), 1)
  q = rng.standard_normal((batch, max_new, heads, WIDTH)).astype(np.float32)
  for b, n in enumerate(query_lengths):
    q[b, n:] = np.nan
  if fp8:
    codes, scales = numpy_quantize(pool[..., :LATENT])
    scales = np.where(np.isfinite(pool[..., 0]), scales, pool[..., 0])  # poison the scales too
    cache = mla.MlaFp8Cache(jnp.asarray(codes), jnp.asarray(scales),
                            jnp.asarray(pool[..., LATENT:], jnp.bfloat16))
  else:
    cache = jnp.asarray(pool, dtype)
  inputs = dict(q=jnp.asarray(q, dtype), cache=cache, page_table=jnp.asarray(table),
                cache_lengths=jnp.asarray(cache_lengths, jnp.int32),
                query_lengths=jnp.asarray(query_lengths, jnp.int32))
  return inputs, rows


def run(inputs, **kwargs):
  out, lse = _jitted(tuple(sorted(kwargs.items())))(**inputs)
  return np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)


@functools.cache
def _jitted(options):
  options = {"scale": SCALE, "implementation": "xla", **dict(options)}
  return jax.jit(functools.partial(jax_flash.mla_decode, return_lse=True, **options))


def attention_weights(q, keys, new, dtype, round_to=None):
  """(weights [new * heads, n] before normalisation, their row sums, row
  maxima) of query rows ``q [new, heads, 576]`` against ``keys [n, 576]``
  (all heads share the keys: one matmul), the last ``new`` keys being the
  rows' own tokens (causal). ``round_to``: logits rounded to that dtype."""
  heads, n = q.shape[1], len(keys)
  logits = (q.reshape(-1, WIDTH).astype(dtype) @ keys.astype(dtype).T) * dtype(SCALE)
  if round_to is not None:
    logits = logits.astype(round_to).astype(dtype)
  visible = np.arange(n)[None] <= (n - new + np.arange(new))[:, None]
  logits = np.where(np.repeat(visible, heads, axis=0), logits, -np.inf)
  top = logits.max(-1, keepdims=True)
  weights = np.exp(logits - top)
  return weights, weights.sum(-1, keepdims=True), top


def each_sequence(inputs, attend):
  """(out [batch, s_q, heads, 512], lse [batch, heads, s_q]) with
  ``attend(b, q rows [new, heads, 576], new) -> (out [new * heads, 512],
  lse [new * heads])`` per sequence; rows without keys zero / -inf."""
  q = np.asarray(inputs["q"], np.float32)
  batch, max_new, heads, _ = q.shape
  out = np.zeros((batch, max_new, heads, LATENT))
  lse = np.full((batch, heads, max_new), -np.inf)
  for b, n in enumerate(np.asarray(inputs["cache_lengths"])):
    new = int(inputs["query_lengths"][b])
    if new and n:
      out_b, lse_b = attend(b, q[b, :new], new)
      out[b, :new] = out_b.reshape(new, heads, LATENT)
      lse[b, :, :new] = lse_b.reshape(new, heads).T
  return out, lse


def attention_over(inputs, rows, *, dtype=np.float64, round_to=None, dequantize=False,
                   sinks=None):
  """MLA over the cache rows ``rows[b] [n, 576]`` in numpy, in ``dtype``
  (float64: the reference); ``round_to``: the naive implementation in that
  dtype (logits, probabilities and output rounded to it); ``dequantize``:
  query and rows as the FP8 format stores them; ``sinks [heads]``: one more
  logit per head in every row's softmax, without a value (rows without keys:
  zero output, lse the sink)."""
  convert = numpy_dequantize if dequantize else (lambda x: x)

  def attend(b, q, new):
    keys = convert(rows[b]).astype(dtype)
    weights, total, top = attention_weights(convert(q), keys, new, dtype, round_to)
    if sinks is not None:
      sink = np.tile(np.asarray(sinks, dtype), new)[:, None]  # row r is head r % heads
      shifted = np.maximum(top, sink)
      weights = weights * np.exp(top - shifted)
      total, top = weights.sum(-1, keepdims=True) + np.exp(sink - shifted), shifted
    p = weights / total
    if round_to is not None:
      p = p.astype(round_to).astype(dtype)
    out = p @ keys[:, :LATENT]
    if round_to is not None:
      out = out.astype(round_to)
    return out, top + np.log(total)

  out, lse = each_sequence(inputs, attend)
  if sinks is not None:
    lse = np.where(lse == -np.inf, np.asarray(sinks, np.float64)[None, :, None], lse)
  return out, lse


def naive_fp8(inputs, rows):
  """A naive FP8 decoder in float32 numpy: the dequantised query and cache
  in float32 products, then P V with the value scales folded into P and P
  rounded to e4m3 with one scale per row over all keys."""

  def attend(b, q, new):
    codes, scales = numpy_quantize(rows[b][:, :LATENT])
    weights, total, top = attention_weights(numpy_dequantize(q), numpy_dequantize(rows[b]), new,
                                            np.float32)
    p_codes, p_scales = numpy_quantize(weights * scales)
    p = p_codes.astype(np.float32) * p_scales[..., None]
    return (p @ codes.astype(np.float32)) / total, top + np.log(total)

  return each_sequence(inputs, attend)


def assert_matches(got, inputs, rows, label, fp8_floor=jnp.float32):
  """The tolerance principle: the bfloat16 cache against the float64
  reference (naive: bfloat16 products); the FP8 cache against the float64
  reference over its dequantised query and cache (naive: naive_fp8), with
  the rounding floor of ``fp8_floor`` (MlaKernelChecks.fp8_floor)."""
  longest = max(max(len(r) for r in rows), 1)
  if isinstance(inputs["cache"], mla.MlaFp8Cache):
    ref = attention_over(inputs, rows, dequantize=True)
    naive, dtype = naive_fp8(inputs, rows), fp8_floor
  else:
    dtype, sinks = inputs["q"].dtype, inputs.get("sinks")
    ref = attention_over(inputs, rows, sinks=sinks)
    naive = attention_over(inputs, rows, dtype=np.float32, round_to=dtype, sinks=sinks)
  for name, g, r, n in zip(("out", "lse"), got, ref, naive):
    numerics.assert_within_tolerance(f"{name} {label}", g, r, n, dtype, reduction=longest)


# Awkward lengths with decode (s_q 1) and speculative (s_q 2) rows, one
# sequence with fewer new tokens than the batch's rows, one empty slot.
BATCHES = [([1, 17, 1000, 4097], [1, 2, 1, 2]), ([17, 300, 64], [2, 0, 1])]
# (sequence, page) pairs whose keys with_dominant_pages makes dominant, for
# make_batch(.., [1000, 4097, 300], ..): at a split's start (GPU splits of
# 1024 keys), inside one, first and second page of a pair (the Hopper
# kernels' consumers alternate pages), a sequence's last.
DOMINANT_PAGES = ([1000, 4097, 300], [1, 2, 2], [(0, 0), (1, 13), (1, 20), (2, 3), (2, 4)])


def with_dominant_pages(inputs, rows, pages, gain=128.0):
  """inputs and rows with the RoPE columns of the (sequence, page) pairs
  ``pages`` times ``gain`` (a power of two: exact in either format): those
  keys' logits spread to about +-200 where the others stay within +-6, so
  the running maximum jumps on them and the other pages' weights fall far
  below the largest (under float32's smallest normal: P's requantisation
  scale must stay finite there)."""
  rows = [r.copy() for r in rows]
  table = np.asarray(inputs["page_table"])
  cache = inputs["cache"]
  fp8 = isinstance(cache, mla.MlaFp8Cache)
  rope = np.array((cache.rope if fp8 else cache[..., LATENT:]).astype(jnp.float32))
  for b, page in pages:
    keys = slice(page * PAGE, min((page + 1) * PAGE, len(rows[b])))
    rows[b][keys, LATENT:] *= gain
    rope[table[b, page], :keys.stop - keys.start] = rows[b][keys, LATENT:]
  if fp8:
    cache = cache._replace(rope=jnp.asarray(rope, cache.rope.dtype))
  else:
    cache = cache.at[..., LATENT:].set(jnp.asarray(rope, cache.dtype))
  return dict(inputs, cache=cache), rows


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_matches_float64(fp8):
  for lengths, new in BATCHES:
    inputs, rows = make_batch(len(lengths), lengths, new, fp8=fp8)
    got = run(inputs)
    assert_matches(got, inputs, rows, f"{lengths} {new}")
    if fp8:
      assert_within_fp8_error_of_unquantised(got[0], inputs, rows)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_pages_far_apart_in_weight(fp8):
  lengths, new, pages = DOMINANT_PAGES
  inputs, rows = with_dominant_pages(*make_batch(31, lengths, new, fp8=fp8), pages)
  assert_matches(run(inputs), inputs, rows, "dominant pages")


def assert_within_fp8_error_of_unquantised(out, inputs, rows):
  """The FP8 output against float64 attention over the bfloat16 cache it
  was quantised from, on the rows that see keys: within the error the
  accuracy study measured."""
  ref, _ = attention_over(inputs, rows)
  seen = np.any(ref != 0, axis=-1)
  error = out[seen] - ref[seen]
  largest = np.max(np.abs(error)) / np.max(np.abs(ref[seen]))
  rms = np.sqrt(np.mean(error ** 2) / np.mean(ref[seen] ** 2))
  assert 0 < largest <= FP8_MAX_ERROR and rms <= FP8_RMS_ERROR, (largest, rms)


@pytest.mark.parametrize("heads", [64, 128])
def test_many_heads(heads):
  inputs, rows = make_batch(heads, [300, 17], [2, 1], heads=heads, fp8=heads == 128)
  assert_matches(run(inputs), inputs, rows, f"heads {heads}")


def test_float16_cache():
  inputs, rows = make_batch(3, [1000, 5], [2, 1], dtype=jnp.float16)
  assert_matches(run(inputs), inputs, rows, "float16")


@pytest.mark.slow
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sweep(fp8):
  rng = np.random.default_rng(1)
  for heads in (16, 64, 128):
    for s_q in (1, 2):
      lengths = [int(n) for n in rng.integers(1, 5000, 3)] + [4097]
      new = [int(rng.integers(1, s_q + 1)) for _ in lengths]
      inputs, rows = make_batch(heads + s_q, lengths, new, heads=heads, fp8=fp8)
      assert_matches(run(inputs), inputs, rows, f"heads {heads} {lengths} {new}")


def test_quantize_latent():
  """Per row: the largest magnitude maps to 448, scale amax / 448 (1 for a
  zero row), the codes those of numpy's rounding; RoPE columns untouched."""
  rng = np.random.default_rng(5)
  rows = rng.standard_normal((6, WIDTH)).astype(np.float32) * 10.0 ** rng.integers(-8, 4, (6, 1))
  rows[2] = 0
  rows[3, :LATENT] = 0
  rows[4, LATENT:] *= 1e3  # RoPE outliers do not change the latent's scale
  codes, scales, rope = mla_fp8.quantize_latent(jnp.asarray(rows))
  want_codes, want_scales = numpy_quantize(rows[:, :LATENT])
  np.testing.assert_array_equal(np.asarray(codes), want_codes)
  np.testing.assert_array_equal(np.asarray(scales), want_scales)
  np.testing.assert_array_equal(np.asarray(rope), rows[:, LATENT:].astype(ml_dtypes.bfloat16))
  assert scales[2] == scales[3] == 1 and not np.asarray(codes[2:4], np.float32).any()
  peak = np.argmax(np.abs(rows[:, :LATENT]), axis=1)
  assert np.all(np.abs(np.asarray(codes, np.float32)[np.arange(6), peak])[[0, 1, 4, 5]] == 448)
  big = np.abs(rows[:, :LATENT]) > 2 ** -6 * np.max(np.abs(rows[:, :LATENT]), 1, keepdims=True)
  error = np.abs(np.asarray(mla_fp8.dequantize_latent(codes, scales, rope))[:, :LATENT]
                 - rows[:, :LATENT])
  # e4m3's unit roundoff on normal codes
  assert np.all(error[big] <= 2 ** -4 * 1.0001 * np.abs(rows[:, :LATENT][big]))


def test_requantize_blocks_scale_per_block():
  """P's requantisation: each 64-key block on its own scale; scaling one
  block by a power of two scales its values exactly, leaving the others."""
  rng = np.random.default_rng(6)
  p = rng.random((3, 4 * PAGE)).astype(np.float32) * np.repeat([1, 1e-3, 0, 5], PAGE)
  got = np.asarray(mla_fp8.requantize_blocks(jnp.asarray(p)))
  codes, scales = numpy_quantize(p.reshape(3, 4, PAGE))
  np.testing.assert_array_equal(got, (codes.astype(np.float32) * scales[..., None]).reshape(3, -1))
  assert not got[:, 2 * PAGE:3 * PAGE].any()
  scaled = p.copy()
  scaled[:, PAGE:2 * PAGE] *= 2 ** -20
  again = np.asarray(mla_fp8.requantize_blocks(jnp.asarray(scaled)))
  np.testing.assert_array_equal(again[:, PAGE:2 * PAGE], got[:, PAGE:2 * PAGE] * 2 ** -20)
  np.testing.assert_array_equal(np.delete(again, np.s_[PAGE:2 * PAGE], 1),
                                np.delete(got, np.s_[PAGE:2 * PAGE], 1))


def test_fp8_requantised_p_against_float32_p():
  """Without P's requantisation the FP8 path is float32 attention over the
  dequantised query and cache (to float32 rounding); with it, the outputs
  move by e4m3 rounding of P (not zero, within naive_fp8's error)."""
  inputs, rows = make_batch(7, [1000, 130], [2, 1], fp8=True)
  args = [inputs[k] for k in ("q", "cache", "page_table", "cache_lengths", "query_lengths")]
  plain = jax.jit(functools.partial(mla_fp8.fp8_reference, scale=SCALE, requantize_p=False))
  out, lse = (np.asarray(x, np.float64) for x in plain(*args))
  ref = attention_over(inputs, rows, dequantize=True)
  seen = np.isfinite(ref[0])
  # bfloat16 output: one rounding of it
  np.testing.assert_allclose(out[seen], ref[0][seen], rtol=2 ** -8, atol=1e-6)
  np.testing.assert_allclose(lse[np.isfinite(ref[1])], ref[1][np.isfinite(ref[1])], rtol=1e-6)
  requantised, _ = run(inputs)
  moved = np.max(np.abs(requantised[seen] - out[seen]))
  naive_error = np.max(np.abs(naive_fp8(inputs, rows)[0][seen] - ref[0][seen]))
  assert 0 < moved <= 2 * naive_error


@pytest.mark.parametrize("fp8", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["bf16", "fp8"])
def test_batch_invariant(fp8):
  """A sequence's rows bitwise: alone, and in another slot of a larger batch
  beside other lengths with its pages elsewhere in a larger pool (the same
  table width and row count: the XLA composition reduces over them)."""
  batch = make_batch(9, [70, 3000, 1000, 1], [1, 2, 2, 1], fp8=fp8, spare_pages=20)[0]
  alone = make_batch(8, [1000], [2], fp8=fp8, max_pages=batch["page_table"].shape[1])[0]
  got_alone, got_mixed = run(alone), run(place_sequence(batch, 2, alone))
  np.testing.assert_array_equal(got_mixed[0][2], got_alone[0][0])
  np.testing.assert_array_equal(got_mixed[1][2], got_alone[1][0])


def place_sequence(batch, slot, single):
  """``batch`` with sequence ``slot`` holding ``single``'s only sequence
  (its query rows and its pages' contents, in ``batch``'s pages)."""
  n = int(single["cache_lengths"][0])
  assert int(batch["cache_lengths"][slot]) == n
  targets = np.asarray(batch["page_table"])[slot, :-(-n // PAGE)]
  sources = np.asarray(single["page_table"])[0, :len(targets)]
  move = lambda to, source: to.at[targets].set(source[sources])
  cache = jax.tree.map(move, batch["cache"], single["cache"])
  q = batch["q"].at[slot, :single["q"].shape[1]].set(single["q"][0])
  return dict(batch, q=q, cache=cache)


def finite_or_zero(tree):
  return jax.tree.map(lambda x: jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype)), tree)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_unseen_positions_never_reach_results(fp8):
  """Unused slots, spare pages and padding rows (NaN and Inf in make_batch)
  and the tokens after each speculative row: the results are the bits of a
  run with zeros there."""
  inputs, _ = make_batch(12, [1000, 300, 5], [2, 1, 0], fp8=fp8)
  clean = dict(inputs, q=finite_or_zero(inputs["q"]), cache=finite_or_zero(inputs["cache"]))
  got, want = run(inputs), run(clean)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])
  assert np.isfinite(got[0]).all()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_visible_nan_reaches_exactly_the_rows_that_see_it(fp8):
  """A NaN in token 999 of sequence 0 (visible to its second row only, as
  the first is token 998) makes that row NaN, every head; the rest keep
  their bits."""
  inputs, _ = make_batch(21, [1000, 90], [2, 1], fp8=fp8)
  page, row = int(inputs["page_table"][0, 999 // PAGE]), 999 % PAGE
  cache = inputs["cache"]
  poisoned = (cache._replace(scales=cache.scales.at[page, row].set(jnp.nan)) if fp8
              else cache.at[page, row, 5].set(jnp.nan))
  clean_out, clean_lse = run(inputs)
  out, lse = run(dict(inputs, cache=poisoned))
  assert np.isnan(out[0, 1]).all() and np.isnan(lse[0, :, 1]).all()
  out[0, 1], lse[0, :, 1] = clean_out[0, 1], clean_lse[0, :, 1]
  np.testing.assert_array_equal(out, clean_out)
  np.testing.assert_array_equal(lse, clean_lse)


def test_rows_without_keys():
  """An empty slot and padding rows: zeros and lse -inf."""
  inputs, _ = make_batch(13, [0, 50], [0, 1], heads=16, spare_pages=1)
  inputs["query_lengths"] = jnp.asarray([0, 1], jnp.int32)
  inputs["q"] = jnp.ones((2, 2, 16, WIDTH), jnp.bfloat16)
  out, lse = run(inputs)
  assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
  assert np.all(out[1, 1] == 0) and np.all(lse[1, :, 1] == -np.inf)
  assert np.isfinite(out[1, 0]).all()


def bits(x):
  """The array's bits as unsigned integers (NaN payloads compared too)."""
  x = np.asarray(x)
  return x.view(f"u{x.itemsize}")


def sink_values(heads, seed):
  """Sinks around the logits' scale, one of them -inf (no sink)."""
  sinks = 2 * np.random.default_rng(seed).standard_normal(heads).astype(np.float32)
  sinks[1] = -np.inf
  return jnp.asarray(sinks)


def test_sinks():
  # BATCHES[1] has a sequence without new tokens and a padding row: their
  # lse is the sink.
  for lengths, new in BATCHES:
    inputs, rows = make_batch(31, lengths, new)
    inputs["sinks"] = sink_values(16, 31)
    assert_matches(run(inputs), inputs, rows, f"sinks {lengths} {new}")


def test_sinks_join_the_fp8_cache_after_the_merge():
  inputs, _ = make_batch(32, *BATCHES[1], fp8=True)
  assert_sinks_join_after_the_merge(run, dict(inputs, sinks=sink_values(16, 32)))


def assert_sinks_join_after_the_merge(attend, inputs):
  """The result with sinks is the result without them, each row
  renormalised by the sink (jax_flash/_sinks.py), computed here in float64:
  the FP8 cache's sinks."""
  sinks = inputs.pop("sinks")
  out, lse = attend(inputs)
  got_out, got_lse = attend(dict(inputs, sinks=sinks))
  sink = np.asarray(sinks, np.float64)[None, :, None]
  want_lse = np.where(lse == -np.inf, sink, np.logaddexp(lse, sink))
  with np.errstate(invalid="ignore"):  # rows without keys and without a sink: -inf - -inf
    weight = np.where(lse == -np.inf, 0.0, np.exp(lse - want_lse))
  weight = np.swapaxes(weight, -1, -2)[..., None]
  np.testing.assert_allclose(got_lse, want_lse, rtol=1e-6)
  np.testing.assert_allclose(got_out, out * weight, rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_write_mla_cache_places_tokens_and_drops_padding(fp8):
  inputs, _ = make_batch(2, [5, 130, 64], [2, 0, 64], fp8=fp8)
  rng = np.random.default_rng(3)
  latent = jnp.asarray(rng.standard_normal((3, 64, WIDTH)) * 3, jnp.bfloat16)
  cache = jax.jit(mla.write_mla_cache)(inputs["cache"], latent, inputs["page_table"],
                                       inputs["cache_lengths"], inputs["query_lengths"])
  table = np.asarray(inputs["page_table"])
  written = np.zeros((jax.tree.leaves(cache)[0].shape[0], PAGE), bool)
  want = mla_fp8.quantize_latent(latent) if fp8 else (latent,)
  for b, (n, new) in enumerate(zip([5, 130, 64], [2, 0, 64])):
    for t in range(new):
      page, row = table[b, (n - new + t) // PAGE], (n - new + t) % PAGE
      for got, part in zip(jax.tree.leaves(cache), want):
        np.testing.assert_array_equal(bits(got[page, row]), bits(part[b, t]))
      written[page, row] = True
  for got, old in zip(jax.tree.leaves(cache), jax.tree.leaves(inputs["cache"])):
    kept = ~written
    np.testing.assert_array_equal(bits(got)[kept], bits(old)[kept])


@pytest.mark.parametrize("kv_dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn],
                         ids=["bf16", "fp16", "fp8"])
def test_decode_step_writes_the_donated_cache_in_place(kv_dtype):
  cache = mla.empty_mla_cache(40, kv_dtype)
  table = jnp.arange(40, dtype=jnp.int32).reshape(2, 20)
  lengths = jnp.asarray([100, 1237], jnp.int32)
  dtype = jnp.float16 if kv_dtype == jnp.float16 else jnp.bfloat16
  latent = jnp.ones((2, 1, WIDTH), dtype)
  q = jnp.ones((2, 1, 16, WIDTH), dtype)

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(cache, q, latent, table, lengths):
    cache = mla.write_mla_cache(cache, latent, table, lengths)
    return jax_flash.mla_decode(q, cache, table, lengths, scale=SCALE), cache

  cache_bytes = sum(x.nbytes for x in jax.tree.leaves(cache))
  # The cache comes back in the donated buffers, not in a copy ...
  memory = step.lower(cache, q, latent, table, lengths).compile().memory_analysis()
  assert memory.alias_size_in_bytes >= cache_bytes
  write = jax.jit(mla.write_mla_cache, donate_argnums=(0,))
  memory = write.lower(cache, latent, table, lengths).compile().memory_analysis()
  assert memory.alias_size_in_bytes >= cache_bytes
  # ... and the write itself needs no scratch of the cache's size, except
  # where XLA:CPU's scatter widens bfloat16 and float8 pools into scratch
  # (docs/mla.md).
  if kv_dtype == jnp.float16:
    assert memory.temp_size_in_bytes < cache_bytes // 10


@pytest.mark.parametrize("fp8, axes", [
    pytest.param(False, "auto", id="bf16-auto"), pytest.param(True, "explicit", id="fp8-explicit"),
    pytest.param(False, "explicit", id="bf16-explicit", marks=pytest.mark.slow),
    pytest.param(True, "auto", id="fp8-auto", marks=pytest.mark.slow)])
def test_tensor_parallel_heads(fp8, axes):
  """128 heads over 8 devices under plain jit, the cache replicated: no
  collective in the compiled program, and each device's 16 heads get the
  bits of the call on those heads alone."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  if len(jax.devices()) < 8:
    pytest.skip(f"needs 8 devices, {jax.default_backend()} has {len(jax.devices())}")
  kind = AxisType.Auto if axes == "auto" else AxisType.Explicit
  mesh = jax.make_mesh((8,), ("tp",), axis_types=(kind,))
  inputs, _ = make_batch(14, [300, 17], [2, 1], heads=128, fp8=fp8)
  heads = NamedSharding(mesh, P(None, None, "tp"))
  placed = {name: jax.device_put(x, heads if name == "q" else NamedSharding(mesh, P()))
            for name, x in inputs.items()}
  out, lse = run(placed)
  for shard in range(8):
    own = slice(16 * shard, 16 * shard + 16)
    want_out, want_lse = run(dict(inputs, q=inputs["q"][:, :, own]))
    np.testing.assert_array_equal(out[:, :, own], want_out)
    np.testing.assert_array_equal(lse[:, own], want_lse)
  compiled = _jitted(()).lower(**placed).compile()
  assert compiled.output_shardings[0].is_equivalent_to(heads, 4)
  text = compiled.as_text()
  assert not [c for c in ("all-gather", "all-reduce", "all-to-all", "collective-permute")
              if c in text]


def test_errors():
  inputs, _ = make_batch(16, [20, 3], [1, 1])
  fp8_inputs, _ = make_batch(16, [20, 3], [1, 1], fp8=True)
  call = lambda base=inputs, **changes: jax_flash.mla_decode(**{**base, **changes}, scale=SCALE)
  cache, fp8_cache = inputs["cache"], fp8_inputs["cache"]
  with pytest.raises(ValueError, match=r"q must be \[batch, s_q, heads, 576\] \(512 latent \+ 64 "
                                       r"RoPE columns\), got shape \(2, 1, 16, 512\)"):
    call(q=inputs["q"][..., :512])
  with pytest.raises(ValueError, match="cache rows must be 576 wide .* got 512"):
    call(cache=cache[..., :512])
  with pytest.raises(ValueError, match=r"sinks must have shape \(16,\) \[heads_q\], got \(3,\)"):
    call(sinks=jnp.zeros(3, jnp.float32))
  with pytest.raises(ValueError, match="sinks must have dtype float32, got bfloat16"):
    call(sinks=jnp.zeros(16, jnp.bfloat16))
  with pytest.raises(ValueError, match="cache must hold pages of 64 tokens .* got 32"):
    call(cache=cache[:, :32])
  with pytest.raises(ValueError, match="q must be bfloat16 or float16, got float32"):
    call(q=inputs["q"].astype(jnp.float32))
  with pytest.raises(ValueError, match="cache must be q's dtype bfloat16 .* got float16"):
    call(cache=cache.astype(jnp.float16))
  with pytest.raises(ValueError, match="cache must be a .* array or an MlaFp8Cache, got list"):
    call(cache=[1, 2])
  with pytest.raises(ValueError, match="q must be bfloat16 with an FP8 cache"):
    call(fp8_inputs, q=fp8_inputs["q"].astype(jnp.float16))
  with pytest.raises(ValueError, match=r"cache.latent must have shape \(5, 64, 512\) \[num_pages, "
                                       r"page_size, width\], got \(5, 64, 500\)"):
    call(fp8_inputs, cache=fp8_cache._replace(latent=fp8_cache.latent[..., :500]))
  with pytest.raises(ValueError, match="cache.rope must be bfloat16, got float16"):
    call(fp8_inputs, cache=fp8_cache._replace(rope=fp8_cache.rope.astype(jnp.float16)))
  with pytest.raises(ValueError, match="cache.scales must hold pages of 64 tokens"):
    call(fp8_inputs, cache=fp8_cache._replace(scales=fp8_cache.scales[:, :32]))
  with pytest.raises(ValueError, match=r"page_table\[1, 0\] = 99 .* page ids must be in \[0, "):
    call(page_table=inputs["page_table"].at[1, 0].set(99))
  with pytest.raises(ValueError, match=r"cache_lengths\[0\] must be in \[query_lengths\[0\]=1, "
                                       r"max_pages \* page_size=64\], got 65"):
    call(cache_lengths=jnp.asarray([65, 3], jnp.int32))
  with pytest.raises(ValueError, match="scale must be given: MLA's softmax scale"):
    jax_flash.mla_decode(**inputs, scale=None)
  with pytest.raises(ValueError, match="implementation must be one of"):
    jax_flash.mla_decode(**inputs, scale=SCALE, implementation="cpu")
  for size in (100, 0, -64, True, 64.0):
    with pytest.raises(ValueError, match="kv_split_size must be None or a positive multiple of "
                                         f"the page size 64, got {size!r}"):
      call(kv_split_size=size)
  with pytest.raises(ValueError, match=r"latent must be \[batch, max_new_tokens, 576\]"):
    mla.write_mla_cache(cache, jnp.zeros((2, 1, 512), jnp.bfloat16), inputs["page_table"],
                        inputs["cache_lengths"])
  with pytest.raises(ValueError, match="latent must have the cache's dtype bfloat16"):
    mla.write_mla_cache(cache, jnp.zeros((2, 1, 576), jnp.float32), inputs["page_table"],
                        inputs["cache_lengths"])
  with pytest.raises(ValueError, match="kv_dtype must be bfloat16, float16 or float8_e4m3fn"):
    mla.empty_mla_cache(4, jnp.float32)


@pytest.mark.slow
def test_benchmark_scripts_run_on_cpu(tmp_path):
  """benchmarks/bench_mla.py --cpu-sizes and mla_accuracy.py at tiny sizes
  write their rows (nothing here judges a time); with latents 3e-3 beside
  RoPE up to 1e3 the RoPE-aware scheme beats the naive one."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
  import bench_mla
  import mla_accuracy
  out = tmp_path / "bench.json"
  assert bench_mla.main(["--cpu-sizes", "--seqs", "70", "--s-qs", "2", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())["rows"]
  assert {(r["impl"], r["variant"], r["kv_dtype"]) for r in rows} == {
      ("jax_flash", "flash", "bfloat16"), ("jax_flash", "xla", "bfloat16"),
      ("xla", "gather", "bfloat16"), ("xla", "contiguous", "bfloat16"),
      ("jax_flash", "flash", "float8_e4m3fn"), ("jax_flash", "xla", "float8_e4m3fn"),
      ("xla", "gather", "float8_e4m3fn")}
  assert all(r["op"] == "mla_decode" and r["seq_k"] == 70 and r["tflops"] > 0 for r in rows)
  out = tmp_path / "accuracy.json"
  assert mla_accuracy.main(["--batch", "1", "--seq-k", "200", "--inputs", "outliers-0.003",
                            "--out", str(out)]) == 0
  rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
  assert set(rows) == set(mla_accuracy.SCHEMES)
  assert (rows["fp8_rope_aware_dequantized"]["out_max_error"]
          < rows["fp8_naive_dequantized"]["out_max_error"] / 2)
