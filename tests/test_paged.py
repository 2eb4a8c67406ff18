"""jax_flash.paged_attention and write_paged_cache: the maths against a
float64 reference on contiguous keys, page placement, poisoned unused slots,
batch invariance, the cache write, and the errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import numerics
from jax_flash import _paged as paged


def make_batch(seed, cache_lengths, query_lengths, *, page_size, heads_q=8, heads_kv=2,
               head_dim=64, dtype=jnp.float32, max_pages=None, spare_pages=3):
  """A ragged batch in a shuffled page pool whose unused slots and pages hold
  NaN and Inf. Returns (inputs for paged_attention, per-sequence contiguous
  keys and values)."""
  rng = np.random.default_rng(seed)
  batch = len(cache_lengths)
  pages_of = [-(-n // page_size) for n in cache_lengths]
  max_pages = max_pages or max(max(pages_of), 1)
  num_pages = sum(pages_of) + spare_pages
  order = rng.permutation(num_pages)
  table = np.full((batch, max_pages), -1, np.int32)  # never read past a sequence's pages
  shape = (num_pages, page_size, heads_kv, head_dim)
  poison = np.where(rng.random(shape) < 0.5, np.nan, np.inf).astype(np.float32)
  k_pool, v_pool = poison.copy(), -poison
  keys, values, used = [], [], 0
  for b, n in enumerate(cache_lengths):
    table[b, :pages_of[b]] = order[used:used + pages_of[b]]
    used += pages_of[b]
    k = rng.standard_normal((n, heads_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((n, heads_kv, head_dim)).astype(np.float32)
    k, v = (x.astype(dtype).astype(np.float32) for x in (k, v))  # numpy: no compilations
    token = np.arange(n)
    k_pool[table[b, token // page_size], token % page_size] = k
    v_pool[table[b, token // page_size], token % page_size] = v
    keys.append(k)
    values.append(v)
  max_new = max(max(query_lengths), 1)
  q = rng.standard_normal((batch, max_new, heads_q, head_dim)).astype(np.float32)
  for b, n in enumerate(query_lengths):
    q[b, n:] = np.nan  # padding rows
  inputs = dict(q=jnp.asarray(q, dtype), k_pages=jnp.asarray(k_pool, dtype),
                v_pages=jnp.asarray(v_pool, dtype), page_table=jnp.asarray(table),
                cache_lengths=jnp.asarray(cache_lengths, jnp.int32),
                query_lengths=jnp.asarray(query_lengths, jnp.int32))
  return inputs, keys, values


def dense_reference(inputs, keys, values, *, causal=True, window=None, scale=None, softcap=None,
                    dtype=np.float64, emulated=False):
  """(out, lse) sequence by sequence over contiguous keys, computed in
  `dtype` (np.float64: the reference; the input dtype: the naive kernel, in
  XLA, or with `emulated` in numpy: float32 products rounded to `dtype`,
  which is what XLA does on a CPU, without a compilation per shape)."""
  q = np.asarray(inputs["q"]).astype(np.float32)  # numpy from here: no compilations
  query_lengths = np.asarray(inputs["query_lengths"])
  batch, max_new, heads_q, head_dim = q.shape
  group = heads_q // keys[0].shape[1]
  scale = 1 / np.sqrt(head_dim) if scale is None else scale
  left, right = (-1, -1) if window is None else window
  if causal:
    right = 0 if right < 0 else min(right, 0)
  out = np.zeros((batch, max_new, heads_q, values[0].shape[-1]))
  lse = np.full((batch, heads_q, max_new), -np.inf)
  if dtype == np.float64:
    cast, einsum = (lambda x: np.asarray(x, np.float64)), _blas_einsum
  elif emulated:
    cast = lambda x: np.asarray(x, np.float32).astype(dtype)
    einsum = lambda spec, a, b: _blas_einsum(spec, a.astype(np.float32), b.astype(
        np.float32)).astype(dtype).astype(np.float64)
  else:
    cast = lambda x: jnp.asarray(x, dtype)
    einsum = lambda *args: np.asarray(jnp.einsum(*args).astype(jnp.float32), np.float64)
  for b, n in enumerate(np.asarray(inputs["cache_lengths"])):
    new = int(query_lengths[b])
    if new == 0 or n == 0:
      continue
    qb = cast(q[b, :new])
    kb, vb = (cast(np.repeat(x, group, axis=1)) for x in (keys[b], values[b]))
    logits = einsum("thd,shd->hts", qb, kb) * scale
    if softcap:
      logits = softcap * np.tanh(logits / softcap)
    pos = n - new + np.arange(new)[:, None]
    key = np.arange(n)[None]
    visible = np.ones((new, n), bool)
    if left >= 0:
      visible &= key >= pos - left
    if right >= 0:
      visible &= key <= pos + right
    logits = np.where(visible[None], logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    seen = np.isfinite(top)
    weights = np.where(visible[None], np.exp(logits - np.where(seen, top, 0)), 0)
    total = weights.sum(-1, keepdims=True)
    probs = weights / np.where(seen, total, 1)
    out[b, :new] = einsum("hts,shd->thd", cast(probs), vb)
    lse[b, :, :new] = np.where(seen, top + np.log(np.where(seen, total, 1)), -np.inf)[..., 0]
  return out, lse


def _blas_einsum(spec, a, b):
  """dense_reference's two products through matmul: np.einsum runs a
  contraction with a batch index (h) without BLAS, seconds at 4k keys."""
  if spec == "thd,shd->hts":
    return np.swapaxes(a, 0, 1) @ np.transpose(b, (1, 2, 0))
  assert spec == "hts,shd->thd", spec
  return np.swapaxes(a @ np.swapaxes(b, 0, 1), 0, 1)


def run_paged(inputs, implementation, **kwargs):
  out, lse = _jitted_paged(implementation, tuple(sorted(kwargs.items())))(**inputs)
  return np.asarray(out.astype(jnp.float32), np.float64), np.asarray(lse, np.float64)


@functools.cache
def _jitted_paged(implementation, options):
  """One jitted call per setting, so that a test's calls on the same shapes
  compile once (conftest.py clears JAX's caches after each test, not this)."""
  return jax.jit(functools.partial(paged.paged_attention, return_lse=True,
                                   implementation=implementation, **dict(options)))


# Awkward lengths, ragged new tokens (decode, speculative, prefill chunks,
# an empty slot), GQA.
BATCHES = [
    ([1, 17, 1000, 4097], [1, 1, 1, 1]),
    ([17, 300, 5, 129], [3, 17, 5, 0]),
    ([4097, 70], [200, 1]),
]


def test_merge_splits_ignores_empty_splits_bitwise():
  rng = np.random.default_rng(1)
  out = jnp.asarray(rng.standard_normal((2, 3, 4, 2, 8)), jnp.bfloat16)
  lse = jnp.asarray(rng.standard_normal((2, 3, 2, 4)), jnp.float32)
  merged = paged.merge_splits(out, lse)
  for extra in (1, 2, 5, 13):
    padded_out = jnp.concatenate([out, jnp.zeros((2, extra, 4, 2, 8), out.dtype)], axis=1)
    padded_lse = jnp.concatenate([lse, jnp.full((2, extra, 2, 4), -jnp.inf)], axis=1)
    for got, want in zip(paged.merge_splits(padded_out, padded_lse), merged):
      np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                    np.asarray(want.astype(jnp.float32)))


def test_write_paged_cache_places_tokens_and_drops_padding():
  inputs, keys, values = make_batch(2, [5, 40, 16], [2, 0, 16], page_size=16, heads_kv=2,
                                    head_dim=8)
  new_k = jax.random.normal(jax.random.key(3), (3, 16, 2, 8))
  new_v = -new_k
  k_pages, v_pages = jax_flash.write_paged_cache(
      inputs["k_pages"], inputs["v_pages"], new_k, new_v, inputs["page_table"],
      inputs["cache_lengths"], inputs["query_lengths"])
  table = np.asarray(inputs["page_table"])
  written = np.zeros(k_pages.shape[:2], bool)
  for b, (n, new) in enumerate(zip([5, 40, 16], [2, 0, 16])):
    for t in range(new):
      page, row = table[b, (n - new + t) // 16], (n - new + t) % 16
      np.testing.assert_array_equal(k_pages[page, row], new_k[b, t])
      np.testing.assert_array_equal(v_pages[page, row], new_v[b, t])
      written[page, row] = True
  old = np.asarray(inputs["k_pages"])
  np.testing.assert_array_equal(np.asarray(k_pages)[~written], old[~written])


def test_decode_step_writes_the_donated_cache_in_place():
  inputs, _, _ = make_batch(4, [100, 37], [1, 1], page_size=16, heads_kv=2, head_dim=64)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(k_pages, v_pages, q, k, v, table, lengths):
    k_pages, v_pages = jax_flash.write_paged_cache(k_pages, v_pages, k, v, table, lengths)
    return jax_flash.paged_attention(q, k_pages, v_pages, table, lengths), k_pages, v_pages

  new = jnp.ones((2, 1, 2, 64))
  args = (inputs["k_pages"], inputs["v_pages"], inputs["q"], new, new, inputs["page_table"],
          inputs["cache_lengths"])
  cache_bytes = inputs["k_pages"].nbytes
  # Both pools come back in the donated buffers, not in copies ...
  assert step.lower(*args).compile().memory_analysis().alias_size_in_bytes >= 2 * cache_bytes
  # ... and the write itself needs no scratch of the pools' size.
  write = jax.jit(jax_flash.write_paged_cache, donate_argnums=(0, 1))
  memory = write.lower(*args[:2], new, new, *args[5:]).compile().memory_analysis()
  assert memory.alias_size_in_bytes >= 2 * cache_bytes
  assert memory.temp_size_in_bytes < cache_bytes // 10


def test_errors():
  inputs, _, _ = make_batch(5, [20, 3], [1, 1], page_size=16)
  call = lambda **changes: jax_flash.paged_attention(**{**inputs, **changes})
  with pytest.raises(ValueError, match=r"page_table\[1, 0\] = 99 .* page ids must be in \[0, "):
    call(page_table=inputs["page_table"].at[1, 0].set(99))
  with pytest.raises(ValueError, match=r"cache_lengths\[0\] must be in \[query_lengths\[0\]=1, "
                                       r"max_pages \* page_size=32\], got 33"):
    call(cache_lengths=jnp.asarray([33, 3], jnp.int32))
  with pytest.raises(ValueError, match=r"page_table must be \[batch=2, max_pages\]"):
    call(page_table=inputs["page_table"][:1])
  with pytest.raises(ValueError, match="page_size must be a multiple of 16 from 16 to 256, got 8"):
    call(k_pages=inputs["k_pages"][:, :8], v_pages=inputs["v_pages"][:, :8])
  with pytest.raises(ValueError, match="kv_split_size must be a positive multiple of page_size 16, "
                                       "got 40"):
    call(kv_split_size=40)
  with pytest.raises(ValueError, match=r"query_lengths\[1\] must be in \[0, 1\], got 2"):
    call(query_lengths=jnp.asarray([1, 2], jnp.int32))
  with pytest.raises(ValueError, match="must share one dtype"):
    call(q=inputs["q"].astype(jnp.bfloat16))
  if jax.default_backend() == "cpu":
    wide = make_batch(5, [20], [1], page_size=16, head_dim=640)[0]
    with pytest.raises(NotImplementedError, match="implementation='flash': the cpu kernels "
                                                  "support head_dim <= 512, got 640"):
      jax_flash.paged_attention(**wide, implementation="flash")


def test_gpu_kernel_reasons(monkeypatch):
  """Which GPU calls take a paged kernel (the CUDA handler runs Hopper's or
  the sm80 family's): the sm80 family's dtypes, head dims and shared memory,
  wherever its GPU rule lets the kernels run."""
  from jax_flash import _ffi, _gpu_support
  monkeypatch.setattr(paged, "_CUDA_REGISTERED", True)
  monkeypatch.setattr(_gpu_support, "gpu_unavailable_reason", lambda: None)
  monkeypatch.setattr(_gpu_support, "gpu_device_kind", lambda: "a GPU")

  def reason(dtype, head_dim, head_dim_v=None, capability=(9, 0)):
    monkeypatch.setattr(_ffi, "gpu_compute_capability", lambda: capability)
    shapes = {"head_dim": head_dim, "head_dim_v": head_dim_v or head_dim, "split_keys": 4096}
    return paged._kernel_unavailable_reason("gpu", np.zeros((1, 1, 1, head_dim), dtype), shapes)

  for head_dim in (64, 96, 128, 192, 256):
    assert reason(jnp.bfloat16, head_dim) is None
    assert reason(jnp.float16, head_dim, capability=(8, 0)) is None
  assert "head_dim in (64, 96, 128, 192, 256), got 80" in reason(jnp.bfloat16, 80)
  assert "dtypes float16, bfloat16, got float32" in reason(jnp.float32, 64)
  assert "head_dim_v == head_dim, got head_dim=192, head_dim_v=128" in reason(
      jnp.bfloat16, 192, 128)
  assert "shared memory" in reason(jnp.bfloat16, 256, capability=(8, 6))
  assert reason(jnp.bfloat16, 128, capability=(8, 6)) is None
  monkeypatch.setattr(_gpu_support, "gpu_unavailable_reason", lambda: "no GPU here")
  assert reason(jnp.bfloat16, 64) == "no GPU here"


def assert_matches_float64(got, inputs, keys, values, dtype, label, **kwargs):
  """The tolerance principle (tests/numerics.py) for out and lse."""
  ref = dense_reference(inputs, keys, values, **kwargs)
  naive = dense_reference(inputs, keys, values, dtype=dtype, emulated=True, **kwargs)
  longest = max(len(k) for k in keys)
  for name, g, r, n in zip(("out", "lse"), got, ref, naive):
    numerics.assert_within_tolerance(f"{name} {label} {kwargs}", g, r, n, dtype,
                                     reduction=max(longest, 1))


def pool_slot(inputs, b, position):
  """(page, row) of token `position` of sequence b."""
  page_size = inputs["k_pages"].shape[1]
  return int(inputs["page_table"][b, position // page_size]), position % page_size


def finite_or_zero(x):
  return jnp.where(jnp.isfinite(x), x, jnp.zeros((), x.dtype))


# Batches, page sizes and masks of the shared checks; causal is bottom-right
# per sequence.
PAGED_BATCHES = [([1, 17, 1000, 4097], [1, 1, 1, 1]), ([17, 300, 5, 129], [3, 17, 5, 0]),
                 ([4097, 70], [40, 1]), ([33, 250], [33, 7])]
PAGE_SIZES = (16, 64, 256, 48)
MASKS = [{}, {"causal": False}, {"window": (33, 0), "softcap": 5.0},
         {"causal": False, "window": (40, 7), "scale": 0.3}]


class PagedChecks:
  """What every backend of paged_attention satisfies on the CPU:
  TestPagedCpuKernel runs them on the C++ kernel (implementation="flash"),
  TestPagedXla on the composition over gathered pages."""

  implementation: str
  dtypes = (jnp.float32, jnp.bfloat16)

  @pytest.fixture(autouse=True)
  def _on_cpu(self):
    # The kernel is chosen from the default backend inside jit (paged.py).
    if jax.default_backend() != "cpu":
      pytest.skip(f"CPU checks; this process's default backend is {jax.default_backend()}")

  def run(self, inputs, **kwargs):
    return run_paged(inputs, self.implementation, **kwargs)

  def test_matches_float64(self, dtype):
    # Awkward lengths, ragged new tokens (decode, speculative, prefill
    # chunks, an empty slot), pages of 16 to 256 and one of 48 (key tiles
    # straddle its pages), shuffled in the pool; a mask each (every mask
    # on every batch: test_every_mask, slow).
    for (lengths, new), page_size, kwargs in zip(PAGED_BATCHES, PAGE_SIZES, MASKS):
      inputs, keys, values = make_batch(page_size, lengths, new, page_size=page_size,
                                        dtype=dtype)
      assert_matches_float64(self.run(inputs, **kwargs), inputs, keys, values, dtype,
                             f"{lengths} {new} page {page_size}", **kwargs)

  @pytest.mark.slow
  @pytest.mark.parametrize("any_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
  def test_every_mask(self, any_dtype):
    for (lengths, new), page_size in zip(PAGED_BATCHES, PAGE_SIZES):
      inputs, keys, values = make_batch(page_size, lengths, new, page_size=page_size,
                                        dtype=any_dtype)
      for kwargs in MASKS:
        assert_matches_float64(self.run(inputs, **kwargs), inputs, keys, values, any_dtype,
                               f"{lengths} {new} page {page_size}", **kwargs)

  @pytest.mark.parametrize("heads", [(8, 8), (8, 1), (6, 2)])
  def test_grouped_heads(self, heads):
    # GQA ratios 1, 8 and 3, and a head dim off the vector width.
    inputs, keys, values = make_batch(7, [1000, 33, 17], [1, 4, 17], page_size=16,
                                      heads_q=heads[0], heads_kv=heads[1], head_dim=40)
    assert_matches_float64(self.run(inputs), inputs, keys, values, jnp.float32, f"heads {heads}")

  def test_batch_invariant(self):
    """A sequence's rows, bitwise: alone, and in another slot of a larger
    batch beside other lengths with its pages elsewhere in a larger pool
    (the same table width and new-token count: the XLA composition's
    reductions run over them)."""
    lengths, new, page = 1000, 3, 16
    batch = make_batch(9, [70, 4000, lengths, 1], [1, 2, new, 1], page_size=page,
                       spare_pages=40)[0]
    alone = make_batch(8, [lengths], [new], page_size=page,
                       max_pages=batch["page_table"].shape[1])[0]
    mixed = place_sequence(batch, 2, alone)
    got_alone, got_mixed = self.run(alone), self.run(mixed)
    np.testing.assert_array_equal(got_mixed[0][2], got_alone[0][0])
    np.testing.assert_array_equal(got_mixed[1][2], got_alone[1][0])

  def test_unseen_positions_never_reach_results(self):
    """Unused slots, spare pages and padding rows (NaN and Inf in
    make_batch) and keys outside every row's window: the results are the
    bits of a run with zeros there."""
    inputs, _, _ = make_batch(12, [1000, 300, 5], [3, 1, 0], page_size=64)
    k_pages, v_pages = np.array(inputs["k_pages"]), np.array(inputs["v_pages"])
    for position in range(900, 1000 - 3 - 20):  # before the window of the first new token
      page, row = pool_slot(inputs, 0, position)
      k_pages[page, row], v_pages[page, row] = np.nan, -np.inf
    poisoned = dict(inputs, k_pages=jnp.asarray(k_pages), v_pages=jnp.asarray(v_pages))
    clean = {**inputs, **{name: finite_or_zero(inputs[name]) for name in ("q", "k_pages",
                                                                         "v_pages")}}
    for kwargs in ({"window": (20, 0)}, {"window": (20, 0), "softcap": 3.0}):
      got, want = self.run(poisoned, **kwargs), self.run(clean, **kwargs)
      np.testing.assert_array_equal(got[0], want[0])
      np.testing.assert_array_equal(got[1], want[1])
      assert np.isfinite(got[0]).all()

  def test_visible_nan_and_inf_propagate(self):
    """One entry poisoned: the rows that see it turn non-finite (their lse
    NaN for a logit), as in a float32 softmax; every other result keeps its
    bits. Sequence 0's six new tokens sit at positions 144-149; the key at
    146 is visible to tokens 2-5 only (causal)."""
    inputs, _, _ = make_batch(21, [150, 90], [6, 1], page_size=16)
    kwargs = dict(window=(40, 0))
    clean_out, clean_lse = self.run(inputs, **kwargs)
    clean_lse = np.swapaxes(clean_lse, 1, 2)  # [batch, new token, query head]
    page, row = pool_slot(inputs, 0, 146)
    huge = jnp.finfo(jnp.float32).max / 4  # a finite query whose logits overflow float32
    cases = {
        "q": (dict(q=inputs["q"].at[0, 3, 1, 5].set(jnp.nan)), (0, 3, 1)),
        "overflow": (dict(q=inputs["q"].at[0, 3, 1].set(huge)), (0, 3, 1)),
        # kv head 0 serves query heads 0-3
        "k": (dict(k_pages=inputs["k_pages"].at[page, row, 0, 5].set(jnp.nan)),
              (0, slice(2, None), slice(0, 4))),
        "v-inf": (dict(v_pages=inputs["v_pages"].at[page, row, 0, 5].set(jnp.inf)),
                  (0, slice(2, None), slice(0, 4))),
    }
    for where, (change, rows) in cases.items():
      reached = np.zeros(clean_out.shape[:3], bool)
      reached[rows] = True
      out, lse = self.run(dict(inputs, **change), **kwargs)
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

  def test_rows_without_keys(self):
    """An empty slot, an empty cache and, inside jit where lengths are not
    checked, a cache shorter than its new tokens (the first rows sit before
    the cache and see nothing): zeros and lse -inf."""
    inputs, keys, values = make_batch(13, [0, 50, 2], [0, 3, 2], page_size=16)
    inputs["query_lengths"] = jnp.asarray([0, 3, 4], jnp.int32)
    inputs["q"] = jax.random.normal(jax.random.key(13), (3, 4, 8, 64))
    out, lse = self.run(inputs)
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
    assert np.all(out[2, :2] == 0) and np.all(lse[2, :, :2] == -np.inf)
    assert np.isfinite(out[1, :3]).all() and np.isfinite(out[2, 2:]).all()
    np.testing.assert_array_equal(out[1, 3:], 0)

  def test_bad_page_ids_and_lengths_inside_jit(self):
    """Unchecked inside jit: a page id outside the pool reads zeros, and a
    cache length past the table clips to it."""
    inputs, keys, values = make_batch(14, [100, 40, 112], [2, 1, 2], page_size=16)
    table = np.asarray(inputs["page_table"]).copy()
    table[0, 2], table[1, 1] = 10_000, -7  # tokens 32-47 of sequence 0, 16-31 of 1
    keys, values = [x.copy() for x in keys], [x.copy() for x in values]
    for b, first in ((0, 32), (1, 16)):
      keys[b][first:first + 16] = values[b][first:first + 16] = 0
    inputs["page_table"] = jnp.asarray(table)
    got = self.run(dict(inputs, cache_lengths=jnp.asarray([100, 40, 2**31 - 1], jnp.int32)))
    assert_matches_float64(got, inputs, keys, values, jnp.float32, "bad ids")
    # An empty pool: every id is outside it.
    empty = dict(inputs, k_pages=inputs["k_pages"][:0], v_pages=inputs["v_pages"][:0])
    zeros = [np.zeros_like(k) for k in keys]
    assert_matches_float64(self.run(empty), inputs, zeros, zeros, jnp.float32, "empty pool")


def place_sequence(batch, slot, single):
  """`batch` with sequence `slot` holding `single`'s only sequence: its
  query rows and the contents of its pages, in `batch`'s pages of that slot
  (which must hold as many tokens)."""
  page_size = batch["k_pages"].shape[1]
  assert int(batch["cache_lengths"][slot]) == int(single["cache_lengths"][0])
  assert int(batch["query_lengths"][slot]) == int(single["query_lengths"][0])
  k_pages, v_pages = np.array(batch["k_pages"]), np.array(batch["v_pages"])
  for i in range(-(-int(single["cache_lengths"][0]) // page_size)):
    target, source = int(batch["page_table"][slot, i]), int(single["page_table"][0, i])
    k_pages[target] = np.asarray(single["k_pages"])[source]
    v_pages[target] = np.asarray(single["v_pages"])[source]
  new = single["q"].shape[1]
  q = batch["q"].at[slot, :new].set(single["q"][0])
  return dict(batch, q=q, k_pages=jnp.asarray(k_pages), v_pages=jnp.asarray(v_pages))


class TestPagedCpuKernel(PagedChecks):
  implementation = "flash"

  def test_serves_the_default_call(self):
    inputs, _, _ = make_batch(15, [40], [1], page_size=16)
    hlo = jax.jit(jax_flash.paged_attention).lower(**inputs).as_text()
    assert paged._CPU_PAGED_TARGET in hlo

  def test_export_holds_the_kernel_of_each_platform(self):
    """The kernel is chosen per lowering platform: exported on this host
    for CUDA, the module holds the XLA composition (or, with "flash",
    fails to lower) rather than the CPU kernel."""
    from jax import export
    inputs, _, _ = make_batch(18, [40, 7], [1, 2], page_size=16)
    allow = [export.DisabledSafetyCheck.custom_call(paged._CPU_PAGED_TARGET)]

    def exported(platforms, implementation=None):
      attend = jax.jit(functools.partial(paged.paged_attention, implementation=implementation))
      return export.export(attend, platforms=platforms, disabled_checks=allow)(
          **inputs).mlir_module()

    assert paged._CPU_PAGED_TARGET in exported(["cpu"])
    assert paged._CPU_PAGED_TARGET in exported(["cpu", "cuda"])
    assert "custom_call" not in exported(["cuda"])
    with pytest.raises(NotImplementedError, match="a paged call traced without a GPU has no "
                                                  "GPU kernel"):
      exported(["cpu", "cuda"], "flash")

  def test_batch_invariant_any_table_and_chunking(self):
    """Beyond the shared check: bitwise the same with a wider page table
    and more query rows in the batch, and a token's row the same as a
    decode step as it is inside a prefill chunk."""
    lengths, page = 1000, 16
    chunk = make_batch(16, [lengths], [37], page_size=page, heads_q=8, heads_kv=2)[0]
    out, lse = self.run(chunk)
    wide = make_batch(17, [lengths, 3000, 45], [37, 1, 40], page_size=page, spare_pages=9)[0]
    wide_out, wide_lse = self.run(place_sequence(wide, 0, chunk))
    np.testing.assert_array_equal(wide_out[0, :37], out[0])
    np.testing.assert_array_equal(wide_lse[0, :, :37], lse[0])
    for t in (0, 17, 36):  # token t as the last of a shorter chunk, then as a decode step
      for new in (t + 1, 1):
        step = dict(chunk, q=chunk["q"][:, t + 1 - new:t + 1],
                    cache_lengths=jnp.asarray([lengths - 36 + t], jnp.int32),
                    query_lengths=jnp.asarray([new], jnp.int32))
        step_out, step_lse = self.run(step)
        np.testing.assert_array_equal(step_out[0, -1], out[0, t])
        np.testing.assert_array_equal(step_lse[0, :, -1], lse[0, :, t])

  @pytest.mark.slow
  @pytest.mark.parametrize("any_dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
  def test_sweep(self, any_dtype):
    """Head dims across the three tile shapes, page sizes, GQA ratios and
    masks."""
    rng = np.random.default_rng(0)
    for head_dim in (16, 64, 72, 128, 200, 256, 320):
      for page_size in (16, 48, 64, 128, 256):
        heads = [(4, 4), (8, 2), (8, 1)][rng.integers(3)]
        lengths = [int(x) for x in rng.integers(1, 3000, 3)]
        new = [int(rng.integers(0, min(n, 70) + 1)) for n in lengths]
        inputs, keys, values = make_batch(head_dim + page_size, lengths, new,
                                          page_size=page_size, heads_q=heads[0],
                                          heads_kv=heads[1], head_dim=head_dim,
                                          dtype=any_dtype)
        for kwargs in MASKS:
          assert_matches_float64(self.run(inputs, **kwargs), inputs, keys, values, any_dtype,
                                 f"hd {head_dim} page {page_size} {lengths} {new} {heads}",
                                 **kwargs)


class TestPagedXla(PagedChecks):
  implementation = "xla"
  dtypes = (jnp.float32,)  # it computes in float32 from any (test_every_mask: all, slow)


@pytest.mark.gpu
class TestPagedGpu:
  # conftest.py parametrises the tests' dtype and head_dim from these. On a
  # Hopper GPU its kernel serves 64, 128 and 256, the sm80 family's 96 and
  # 192; on 8.x the sm80 family's serves all.
  dtypes = (jnp.bfloat16, jnp.float16)
  head_dims = (64, 96, 128, 192, 256)

  @pytest.mark.parametrize("page_size", [16, 64, 256])
  def test_matches_reference(self, dtype, head_dim, page_size):
    for lengths, new in BATCHES:
      inputs, keys, values = make_batch(head_dim + page_size, lengths, new, page_size=page_size,
                                        head_dim=head_dim, dtype=dtype)
      for kwargs in ({}, {"causal": False}, {"window": (100, 0), "softcap": 8.0}):
        got = run_paged(inputs, "flash", kv_split_size=max(page_size, 256), **kwargs)
        ref = dense_reference(inputs, keys, values, **kwargs)
        naive = dense_reference(inputs, keys, values, dtype=dtype, **kwargs)
        for name, g, r, n in zip(("out", "lse"), got, ref, naive):
          numerics.assert_within_tolerance(f"{name} {lengths} {new} {kwargs}", g, r, n, dtype,
                                           reduction=max(lengths))

  @pytest.mark.parametrize("heads", [(8, 8), (8, 1), (32, 8)])
  def test_grouped_heads(self, heads):
    inputs, keys, values = make_batch(7, [1000, 33], [1, 4], page_size=32, heads_q=heads[0],
                                      heads_kv=heads[1], head_dim=128, dtype=jnp.bfloat16)
    got = run_paged(inputs, "flash")
    ref = dense_reference(inputs, keys, values)
    naive = dense_reference(inputs, keys, values, dtype=jnp.bfloat16)
    for name, g, r, n in zip(("out", "lse"), got, ref, naive):
      numerics.assert_within_tolerance(name, g, r, n, jnp.bfloat16, reduction=1000)

  def test_batch_invariant(self):
    """One sequence's rows, bitwise: alone, in another slot of a larger
    batch beside other lengths, with its pages moved, and computed as the
    last row of a prefill chunk rather than as a decode step."""
    lengths, page = 3000, 16
    inputs, _, _ = make_batch(8, [lengths], [1], page_size=page, head_dim=128,
                              dtype=jnp.bfloat16)
    # Splits of 1024 keys: the sequence's three merge with the others' empty ones.
    run = functools.partial(run_paged, implementation="flash", kv_split_size=1024)
    alone, alone_lse = run(inputs)
    others, _, _ = make_batch(9, [70, 5000, lengths, 1], [1, 1, 1, 1], page_size=page,
                              head_dim=128, dtype=jnp.bfloat16, spare_pages=40)
    # Sequence 2 of the larger batch gets the first batch's keys, query and pages' contents.
    table = np.asarray(others["page_table"])
    k_pages, v_pages = np.array(others["k_pages"]), np.array(others["v_pages"])
    source = np.asarray(inputs["page_table"])[0]
    for i in range(-(-lengths // page)):
      k_pages[table[2, i]] = np.asarray(inputs["k_pages"])[source[i]]
      v_pages[table[2, i]] = np.asarray(inputs["v_pages"])[source[i]]
    others.update(k_pages=jnp.asarray(k_pages), v_pages=jnp.asarray(v_pages),
                  q=others["q"].at[2].set(inputs["q"][0]))
    mixed, mixed_lse = run(others)
    np.testing.assert_array_equal(mixed[2], alone[0])
    np.testing.assert_array_equal(mixed_lse[2], alone_lse[0])
    # The same token as the last of a 37-token prefill chunk.
    chunk = 37
    prefill = dict(inputs, q=jnp.concatenate(
        [jax.random.normal(jax.random.key(1), (1, chunk - 1, 8, 128), jnp.bfloat16),
         inputs["q"]], axis=1), query_lengths=jnp.asarray([chunk], jnp.int32))
    chunked, chunked_lse = run(prefill)
    np.testing.assert_array_equal(chunked[0, -1], alone[0, 0])
    np.testing.assert_array_equal(chunked_lse[0, :, -1], alone_lse[0, :, 0])

  def test_export_holds_the_kernel_of_each_platform(self):
    from jax import export
    inputs, _, _ = make_batch(14, [100, 7], [1, 2], page_size=16, head_dim=64,
                              dtype=jnp.bfloat16)
    attend = jax.jit(functools.partial(paged.paged_attention, implementation="flash"))
    allow = [export.DisabledSafetyCheck.custom_call(target)
             for target in (paged._PAGED_TARGET, paged._CPU_PAGED_TARGET)]
    module = export.export(attend, platforms=["cpu", "cuda"],
                           disabled_checks=allow)(**inputs).mlir_module()
    assert paged._PAGED_TARGET in module and paged._CPU_PAGED_TARGET in module

  def test_empty_and_padded_rows(self):
    inputs, keys, values = make_batch(10, [0, 50], [0, 3], page_size=16, head_dim=64,
                                      dtype=jnp.bfloat16)
    out, lse = run_paged(inputs, "flash")
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
    assert np.all(np.isfinite(out[1]))


def test_tensor_parallel_over_kv_heads():
  """Heads sharded over a mesh axis (tensor-parallel serving): each device
  holds its kv heads' slice of every page and runs the call on its heads;
  the page table and lengths are the same everywhere."""
  from jax.sharding import PartitionSpec as P
  if len(jax.devices()) < 4:
    pytest.skip(f"needs 4 devices, {jax.default_backend()} has {len(jax.devices())}")
  mesh = jax.make_mesh((4,), ("tp",))
  inputs, keys, values = make_batch(11, [300, 17], [1, 5], page_size=16, heads_q=8, heads_kv=4,
                                    head_dim=32)
  heads, replicated = P(None, None, "tp"), P()
  attend = jax.jit(jax.shard_map(
      lambda q, k, v, t, n, m: jax_flash.paged_attention(q, k, v, t, n, query_lengths=m,
                                                         return_lse=True),
      mesh=mesh, in_specs=(heads, heads, heads, replicated, replicated, replicated),
      out_specs=(heads, P(None, "tp"))))
  placed = [jax.device_put(x, jax.sharding.NamedSharding(mesh, spec)) for x, spec in
            zip(inputs.values(), (heads, heads, heads, replicated, replicated, replicated))]
  out, lse = attend(*placed)
  ref_out, ref_lse = dense_reference(inputs, keys, values)
  np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=1e-4)
  np.testing.assert_allclose(np.asarray(lse)[np.isfinite(ref_lse)], ref_lse[np.isfinite(ref_lse)],
                             atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["bfloat16", "fp8"])
@pytest.mark.parametrize("axes", ["auto", "explicit"])
def test_sharded_under_jit(axes, cache):
  """Heads (with their kv heads' slice of the pool, an FP8 pool's scales too)
  and sequences (with their table rows) sharded under plain ``jit``: each
  device runs the kernel on its shard, no collective, bitwise unsharded."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  # 8 virtual CPU devices, or the GPUs of a 2-GPU machine (in bfloat16 at
  # head dim 64, so that a GPU runs its paged kernel).
  if len(jax.devices()) < 2:
    pytest.skip(f"needs 2 devices, {jax.default_backend()} has {len(jax.devices())}")
  kind = AxisType.Auto if axes == "auto" else AxisType.Explicit
  shape = (2, 4) if len(jax.devices()) >= 8 else (1, 2)
  mesh = jax.make_mesh(shape, ("dp", "tp"), axis_types=(kind, kind),
                       devices=jax.devices()[:shape[0] * shape[1]])
  inputs, _, _ = make_batch(12, [300, 17, 64, 1], [1, 5, 2, 1], page_size=16, heads_q=8,
                            heads_kv=4, head_dim=64, dtype=jnp.bfloat16)
  pool = P(None, None, "tp")
  if cache == "fp8":
    for name in ("k_pages", "v_pages"):
      inputs[name] = jax_flash.Fp8Pages.quantize(inputs[name])
    pool = jax_flash.Fp8Pages(pool, P(None, "tp"))
  specs = (P("dp", None, "tp"), pool, pool, P("dp"), P("dp"), P("dp"))
  placed = [jax.device_put(x, jax.tree.map(lambda s: NamedSharding(mesh, s), s))
            for x, s in zip(inputs.values(), specs)]
  attend = jax.jit(lambda q, k, v, t, n, m: jax_flash.paged_attention(
      q, k, v, t, n, query_lengths=m, return_lse=True))
  out, lse = attend(*placed)
  want_out, want_lse = attend(*inputs.values())
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", None, "tp")), 4)
  compiled = attend.lower(*placed).compile().as_text()
  assert not [c for c in ("all-gather", "all-reduce", "all-to-all", "collective-permute")
              if c in compiled]


@pytest.mark.parametrize("fp8_scales", [False, True])
def test_partitioning_of_split_outputs(fp8_scales):
  """The GPU kernel's outputs hold batch x splits rows (sharding.py's rule
  "(b x)"): a stand-in kernel with three splits partitions over batch and
  heads like the real one, without collectives; an FP8 cache's scales [P,
  Hkv, S] shard with their kv heads (each head's output adds one of them)."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  from jax_flash import _sharding as sharding
  if len(jax.devices()) < 8:
    pytest.skip(f"needs 8 devices, {jax.default_backend()} has {len(jax.devices())}")
  splits = 3

  def stand_in(rows, k_pages, v_pages, *operands):
    # Reads every operand; split s of sequence b holds rows[b] + s.
    *scales, table, q_lens, kv_lens = operands
    offset = (jnp.sum(k_pages) + jnp.sum(v_pages) + jnp.sum(table) + jnp.sum(q_lens + kv_lens)) * 0
    out = (rows[:, None] + jnp.arange(splits, dtype=rows.dtype)[:, None, None, None] + offset)
    if scales:
      per_head = jnp.repeat(scales[0][0, :, 0], rows.shape[2] // k_pages.shape[2])
      out = out + (per_head[:, None] + jnp.sum(scales[1]) * 0).astype(rows.dtype)
    out = out.reshape(-1, *rows.shape[1:])
    return out, jnp.swapaxes(out[..., 0], 1, 2).astype(jnp.float32)

  mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  inputs, _, _ = make_batch(13, [40, 17, 64, 1], [2, 2, 2, 2], page_size=16, heads_q=8,
                            heads_kv=4, head_dim=32)
  pools = [inputs["k_pages"], inputs["v_pages"]]
  specs = [P("dp", None, "tp")] + [P(None, None, "tp")] * 2
  if fp8_scales:
    num_pages, page_size, heads_kv, _ = inputs["k_pages"].shape
    scales = jax.random.uniform(jax.random.key(3), (2, num_pages, heads_kv, page_size))
    pools += list(scales)
    specs += [P(None, "tp")] * 2
  args = [inputs["q"], *pools, inputs["page_table"], inputs["query_lengths"],
          inputs["cache_lengths"]]
  specs += [P("dp")] * 3
  run = jax.jit(sharding.paged_partitioned(stand_in, splits, fp8_scales=fp8_scales))
  placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
  (out, lse), (want_out, want_lse) = run(*placed), stand_in(*args)
  for got, want in zip(run(*args), (want_out, want_lse)):  # unsharded, on one device
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("dp", None, "tp")), 4)
  assert "all-gather" not in run.lower(*placed).compile().as_text()
