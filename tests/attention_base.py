"""The specification of jax_flash.attention, run against every backend.

Each backend's test class sets ``implementation`` and the dtypes / head dims
it supports; conftest.py parametrises the ``dtype`` and ``head_dim``
arguments from those attributes.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import numerics
from attention_sinks import SinksSpec
from jax_flash import _reference as reference


def run_attention(q, k, v, dout, implementation, **kwargs):
  """(out, lse, dq, dk, dv) from jax_flash.attention, under jit."""

  @jax.jit
  def forward_backward(q, k, v, dout):
    def f(q, k, v):
      return jax_flash.attention(q, k, v, return_lse=True, implementation=implementation,
                                 **kwargs)

    (out, lse), pullback = jax.vjp(f, q, k, v)
    return (out, lse, *pullback((dout, jnp.zeros_like(lse))))

  return tuple(np.asarray(jnp.asarray(x, jnp.float32)) for x in forward_backward(q, k, v, dout))


def mask_kwargs(seq_q, seq_k, causal=False, window=None, q_lens=None, kv_lens=None,
                segment_ids=None):
  """The reference's mask arguments for jax_flash.attention's conventions."""
  left, right = (-1, -1) if window is None else (
      -1 if window[0] is None else window[0], -1 if window[1] is None else window[1])
  if causal:
    right = 0 if right < 0 else min(right, 0)
  q_ids, kv_ids = (segment_ids if isinstance(segment_ids, tuple)
                   else (segment_ids, segment_ids))
  return dict(diag_offset=seq_k - seq_q, window_left=left, window_right=right, q_lens=q_lens,
              kv_lens=kv_lens, q_segment_ids=q_ids, kv_segment_ids=kv_ids)


def packed_segment_ids(seed, batch, seq, num_docs, padding=0):
  """[batch, seq] int32 ids of num_docs back-to-back documents of random
  lengths per row, then `padding` tokens of id -1."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, seq - padding), num_docs - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [seq - padding]]))
    rows.append(np.concatenate([np.repeat(np.arange(num_docs), lengths), -np.ones(padding)]))
  return jnp.asarray(np.stack(rows), jnp.int32)


def visibility(batch, seq_q, seq_k, **mask) -> np.ndarray:
  """Bool [batch, seq_q, seq_k]: which key each query sees (mask_kwargs' mask)."""
  visible = reference.visible_mask(seq_q, seq_k, **mask)[:, 0]
  return np.broadcast_to(np.asarray(visible), (batch, seq_q, seq_k))


def poison(x, rows, seed):
  """``x`` [B, T, heads, D] with the rows ``rows`` [B, T] (bool) holding NaN,
  +Inf and -Inf, mixed."""
  values = np.asarray([np.nan, np.inf, -np.inf], np.float32)
  pick = values[np.random.default_rng(seed).integers(0, 3, x.shape)]
  return jnp.where(jnp.asarray(rows)[:, :, None, None], jnp.asarray(pick, x.dtype), x)


def assert_unaffected_equal(clean, poisoned, visible, bad_q, bad_k, dq_exact=True):
  """The results that no poisoned position may reach equal the clean run's.

  ``bad_q`` [B, T]: query rows whose q and dout were poisoned; ``bad_k``
  [B, S]: key rows whose k and v were. A query row is reached when it is
  poisoned and sees a key, or sees a poisoned key; a key row when a reached
  row sees it, or it is poisoned and some row sees it. Every other entry of
  out, lse, dq, dk and dv must be bitwise what it was; dq only up to its
  rounding where not dq_exact (a backward that adds it with atomics, in an
  order that differs run to run), its NaN and Inf still exactly. Returns
  the reached query rows.
  """
  sees_any = visible.any(axis=2)
  reached_q = (bad_q & sees_any) | (visible & bad_k[:, None, :]).any(axis=2)
  reached_k = (visible & reached_q[:, :, None]).any(axis=1) | (bad_k & visible.any(axis=1))
  out, lse, dq, dk, dv = clean
  p_out, p_lse, p_dq, p_dk, p_dv = poisoned
  keep_q, keep_k = ~reached_q, ~reached_k
  for name, a, b, keep in (("out", out, p_out, keep_q), ("dq", dq, p_dq, keep_q),
                           ("lse", np.swapaxes(lse, 1, 2), np.swapaxes(p_lse, 1, 2), keep_q),
                           ("dk", dk, p_dk, keep_k), ("dv", dv, p_dv, keep_k)):
    if name == "dq" and not dq_exact:
      np.testing.assert_allclose(b[keep], a[keep], rtol=1e-2, atol=1e-3,
                                 err_msg=f"{name}: a masked NaN / Inf leaked")
    else:
      np.testing.assert_array_equal(b[keep], a[keep], err_msg=f"{name}: a masked NaN / Inf leaked")
  return reached_q


class AttentionTestBase(SinksSpec):  # attention sinks: tests/attention_sinks.py
  implementation: str
  dtypes: tuple
  head_dims: tuple
  # Whether gradients are bitwise reproducible run to run.
  deterministic_backward = True
  # Repeats of the deterministic backward compared bitwise with the first
  # run: many where threads race for the order of a sum (GPU turns), fewer
  # where no two tasks share an output (the CPU kernels).
  deterministic_repeats = 9
  long_seq = 4097
  # (seq_q, seq_k) of a causal hd256 problem that the Hopper forward launches
  # in several sections of heads (cuda_src/fwd_sm90/launch_order.py); None
  # where the backend has no such order and the size would only cost time.
  sectioned_grid = None

  def check(self, *, batch=2, seq_q=113, seq_k=241, heads_q=4, heads_kv=2, head_dim=64,
            head_dim_v=None, dtype=jnp.bfloat16, causal=False, window=None, q_lens=None,
            kv_lens=None, segment_ids=None, softcap=None, deterministic=False, seed=0):
    q, k, v, dout = numerics.random_qkv(seed, batch, seq_q, seq_k, heads_q, heads_kv, head_dim,
                                        dtype, head_dim_v)
    scale = 1.0 / np.sqrt(head_dim)
    got = run_attention(q, k, v, dout, self.implementation, causal=causal, window=window,
                        query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens,
                        segment_ids=segment_ids, softcap=softcap, deterministic=deterministic)
    mask = mask_kwargs(seq_q, seq_k, causal, window, q_lens, kv_lens, segment_ids)
    mask["softcap"] = softcap or 0.0
    ref = numerics.float64_reference(q, k, v, dout, scale=scale, **mask)
    naive = numerics.naive(q, k, v, dout, scale=scale, **mask)
    for name, g, r, n in zip(("out", "lse", "dq", "dk", "dv"), got, ref, naive):
      numerics.assert_within_tolerance(name, g, r, n, dtype, reduction=max(seq_q, seq_k))
    return got

  @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
  def test_matches_reference(self, dtype, head_dim, causal):
    self.check(dtype=dtype, head_dim=head_dim, causal=causal)

  @pytest.mark.parametrize("case", ["full", "causal", "window", "gqa-lengths", "documents",
                                    "many-keys", "many-queries", "softcap", "decode", "deterministic",
                                    "deterministic-full", "deterministic-documents"])
  def test_smaller_value_head_dim(self, dtype, case):
    # DeepSeek's prefill shape, queries and keys 192 wide and values 128, has
    # kernels of its own on Hopper, but for the backward of deterministic
    # packed documents (the library says: _plan._sm90_backward); elsewhere V is padded.
    kw = dict(head_dim=192, head_dim_v=128, dtype=dtype)
    if case in ("full", "causal"):
      self.check(seq_q=200, seq_k=333, causal=case == "causal", **kw)
    elif case in ("deterministic", "deterministic-full"):
      self.check(seq_q=200, seq_k=333, causal=case == "deterministic", deterministic=True, **kw)
    elif case == "deterministic-documents":
      self._check_mask_case("documents", deterministic=True, **kw)
    elif case == "softcap":
      self.check(seq_q=150, seq_k=150, causal=True, softcap=1.5, **kw)
    elif case == "decode":
      self.check(batch=3, seq_q=1, seq_k=2100, heads_q=8, heads_kv=2, causal=True,
                 kv_lens=jnp.array([2100, 700, 0], jnp.int32), **kw)
    else:
      self._check_mask_case(case, **kw)

  @pytest.mark.parametrize("seq_q,seq_k", [(1, 1), (17, 17), (1000, 1000), (17, 1000),
                                           (1000, 17), (1, 4097), ("long", "long")])
  @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
  def test_awkward_lengths(self, seq_q, seq_k, causal):
    seq_q = self.long_seq if seq_q == "long" else seq_q
    seq_k = self.long_seq if seq_k == "long" else seq_k
    self.check(batch=1, seq_q=seq_q, seq_k=seq_k, heads_q=2, heads_kv=1, dtype=self.dtypes[0],
               causal=causal)

  @pytest.mark.parametrize("seq_q,causal", [(1, True), (3, False), (1, False)],
                           ids=["decode-causal", "short", "decode"])
  def test_short_queries_pack_query_heads(self, seq_q, causal):
    # Fewer queries than a kernel tile: the GQA group's heads share the tile.
    kv_lens = jnp.array([290, 17], jnp.int32)
    self.check(seq_q=seq_q, seq_k=301, heads_q=8, heads_kv=2, causal=causal,
               kv_lens=kv_lens, dtype=self.dtypes[0])

  def test_decoding_long_cache(self):
    # Few query tiles over many keys: the GPU forward splits the keys into
    # chunks (kv_split.py) and merges them.
    self.check(batch=3, seq_q=1, seq_k=4096, heads_q=8, heads_kv=2, causal=True,
               kv_lens=jnp.array([4096, 700, 0], jnp.int32), dtype=self.dtypes[0])

  def test_short_queries_with_documents_and_lengths(self):
    q_ids = jnp.array([[0, 0, 1, 1, 1, 2, 2], [3, 3, 3, 3, 4, 4, 4]], jnp.int32)
    kv_ids = jnp.repeat(jnp.array([[0, 1, 2, 1], [3, 4, 4, 3]], jnp.int32), 50, axis=1)
    self.check(seq_q=7, seq_k=200, heads_q=6, heads_kv=2, segment_ids=(q_ids, kv_ids),
               q_lens=jnp.array([7, 5], jnp.int32), dtype=self.dtypes[0])

  @pytest.mark.parametrize("case", ["window", "gqa-lengths", "documents", "many-keys",
                                    "many-queries"])
  def test_masks_at_every_head_dim(self, head_dim, case):
    # Each head dim has kernels of its own (tiles, shared-memory plans, how
    # the warpgroups split the work): every kind of mask runs on each.
    self._check_mask_case(case, head_dim=head_dim, dtype=self.dtypes[0])

  def _check_mask_case(self, case, **kw):
    if case == "window":
      self.check(seq_q=260, seq_k=260, window=(70, 5), **kw)
    elif case == "gqa-lengths":
      self.check(seq_q=190, seq_k=300, heads_q=8, heads_kv=2, causal=True,
                 q_lens=jnp.array([190, 61], jnp.int32), kv_lens=jnp.array([123, 300], jnp.int32),
                 **kw)
    elif case == "documents":
      ids = packed_segment_ids(14, batch=2, seq=300, num_docs=4, padding=9)
      self.check(seq_q=300, seq_k=300, segment_ids=ids, causal=True, **kw)
    elif case == "many-keys":
      self.check(batch=1, seq_q=130, seq_k=1100, heads_q=2, heads_kv=1, **kw)
    else:
      # Enough query tiles for the Hopper forward's paired CTAs (odd in
      # number, so the last pair's second CTA lies past the queries), and a
      # row length that leaves one CTA of a pair without a visible row.
      seq_q = self.long_seq
      self.check(seq_q=seq_q, seq_k=333, q_lens=jnp.array([seq_q, seq_q - 197], jnp.int32),
                 kv_lens=jnp.array([333, 200], jnp.int32), **kw)

  @pytest.mark.parametrize("heads_q,heads_kv", [(8, 8), (8, 4), (8, 2), (8, 1)],
                           ids=["mha", "gqa2", "gqa4", "mqa"])
  def test_grouped_heads(self, heads_q, heads_kv):
    self.check(heads_q=heads_q, heads_kv=heads_kv, seq_q=77, seq_k=130, dtype=self.dtypes[0])

  @pytest.mark.parametrize("window", [(16, 0), (8, 8), (0, None), (None, 5), (40, 3)])
  @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
  def test_sliding_window(self, window, causal):
    self.check(seq_q=150, seq_k=150, window=window, causal=causal, dtype=self.dtypes[0])

  @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
  def test_sequence_lengths(self, causal):
    q_lens = jnp.array([70, 0, 113], jnp.int32)
    kv_lens = jnp.array([241, 50, 0], jnp.int32)
    out, lse, dq, dk, dv = self.check(batch=3, q_lens=q_lens, kv_lens=kv_lens, causal=causal,
                                      dtype=self.dtypes[0])
    # Padding is exact: zero outputs and zero gradients, no rounding.
    assert np.all(out[0, 70:] == 0) and np.all(out[1] == 0) and np.all(out[2] == 0)
    assert np.all(dq[0, 70:] == 0) and np.all(dk[0, 241:] == 0)
    assert np.all(dk[1, 50:] == 0) and np.all(dv[1, 50:] == 0)
    assert np.all(dk[2] == 0) and np.all(dv[2] == 0) and np.all(dq[2] == 0)
    assert np.all(np.isneginf(lse[1])) and np.all(np.isneginf(lse[2]))

  def test_lengths_past_the_sequence_cover_it(self):
    # The default lengths (_call.whole_lengths) rely on this.
    q, k, v, _ = numerics.random_qkv(0, 2, 113, 241, 4, 2, 64, self.dtypes[0])
    attend = functools.partial(jax_flash.attention, q, k, v, causal=True,
                               implementation=self.implementation)
    longer = attend(query_seq_lengths=jnp.array([113, 500], jnp.int32),
                    key_value_seq_lengths=jnp.array([2**31 - 1, 241], jnp.int32))
    np.testing.assert_array_equal(np.asarray(longer), np.asarray(attend()))

  def test_default_lengths_are_no_work_per_call(self):
    if self.implementation == "xla":
      pytest.skip("the reference applies no lengths unless given")
    q, k, v, _ = numerics.random_qkv(0, 16, 64, 64, 4, 4, 64, self.dtypes[0])
    attend = functools.partial(jax_flash.attention, implementation=self.implementation)
    compiled = jax.jit(attend).lower(q, k, v).compile().as_text()
    # One length repeated would be a broadcast kernel launched on every call.
    assert " broadcast(" not in compiled

  def test_long_rows_of_unequal_reach(self):
    # Past 2048 queries the Hopper forward's hd64 tiles are 192 rows over
    # 128-key tiles, whose warpgroups then see different numbers of KV tiles
    # under a right window and pass the others on; 4097 rows leave a partial
    # tile, placed before row 0, and the shorter row lengths whole warpgroups
    # without a row.
    seq = self.long_seq
    self.check(seq_q=seq, seq_k=seq + 60, heads_q=2, heads_kv=1, window=(None, 70),
               q_lens=jnp.array([seq, seq - 300], jnp.int32),
               kv_lens=jnp.array([seq + 60, seq - 500], jnp.int32), dtype=self.dtypes[0])

  def test_causal_grid_in_sections(self):
    if self.sectioned_grid is None:
      pytest.skip("only the Hopper forward launches its grid in sections")
    seq_q, seq_k = self.sectioned_grid
    # Three kv heads' K / V fit the L2 budget, so the ten heads of two batch
    # entries run as sections of 1, 3, 3 and 3 heads, two of them spanning
    # both entries, behind a bottom-right diagonal.
    self.check(batch=2, seq_q=seq_q, seq_k=seq_k, heads_q=5, heads_kv=5, head_dim=256,
               causal=True, dtype=self.dtypes[0])

  def test_fully_masked_rows(self):
    # Bottom-right causal with seq_q > seq_k: the first 60 query rows see no key.
    out, lse, dq, dk, dv = self.check(seq_q=100, seq_k=40, causal=True, dtype=self.dtypes[0])
    assert np.all(out[:, :60] == 0) and np.all(np.isneginf(lse[:, :, :60]))
    assert np.all(dq[:, :60] == 0)
    for grad in (dq, dk, dv):
      assert np.all(np.isfinite(grad))

  def test_repeated_runs_bitwise_equal(self):
    q, k, v, dout = numerics.random_qkv(3, 2, 200, 300, 4, 2, self.head_dims[0], self.dtypes[0])
    first = run_attention(q, k, v, dout, self.implementation, causal=True)
    for _ in range(2):
      again = run_attention(q, k, v, dout, self.implementation, causal=True)
      chex.assert_trees_all_equal(first[:2], again[:2])
      if self.deterministic_backward:
        chex.assert_trees_all_equal(first[2:], again[2:])

  @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
  def test_softcap(self, dtype, head_dim, causal):
    # A cap of 1.5 bends most logits of unit-variance scores (tanh is far from
    # linear there), so a kernel that skipped it or its gradient would fail.
    self.check(dtype=dtype, head_dim=head_dim, causal=causal, softcap=1.5, seq_q=150,
               seq_k=333)

  def test_softcap_saturated(self, head_dim):
    # A cap of 0.25 on unit-variance scores saturates tanh for most pairs:
    # 1 - tanh^2 is small there, and a backward that recovers tanh from P
    # (bwd_sm90) must keep it accurate. The causal mask's bottom-right
    # alignment leaves the first 90 query rows without keys (P = 0, lse
    # -inf), whose gradients must come out 0, not NaN.
    self.check(dtype=self.dtypes[0], head_dim=head_dim, causal=True, softcap=0.25, seq_q=290,
               seq_k=200)

  def test_softcap_with_documents_and_window(self):
    ids = packed_segment_ids(14, batch=2, seq=260, num_docs=3)
    self.check(seq_q=260, seq_k=260, segment_ids=ids, window=(70, 0), softcap=3.0,
               dtype=self.dtypes[0])

  @pytest.mark.parametrize("case", ["causal_gqa", "window", "documents", "lengths", "causal_lengths",
                                    "few_queries", "few_keys"])
  def test_deterministic_backward(self, case):
    # causal_lengths: the turns of a causal mask may be taken from the last
    # KV tile that sees a query tile down, which lengths cut short. Without a
    # mask the KV tiles take turns in a rotated order, which few_queries (more
    # KV tiles than query tiles) and few_keys test at its edges.
    lengths = dict(q_lens=jnp.array([700, 321], jnp.int32), kv_lens=jnp.array([555, 700], jnp.int32))
    kwargs = {"causal_gqa": dict(causal=True),
              "window": dict(window=(200, 30)),
              "documents": dict(causal=True,
                                segment_ids=packed_segment_ids(15, batch=2, seq=700, num_docs=4)),
              "lengths": lengths,
              "causal_lengths": dict(causal=True, **lengths),
              "few_queries": {}, "few_keys": {}}[case]
    seq_q, seq_k = {"few_queries": (130, 700), "few_keys": (700, 200)}.get(case, (700, 700))
    first = self.check(seq_q=seq_q, seq_k=seq_k, heads_q=8, heads_kv=2, head_dim=self.head_dims[0],
                       dtype=self.dtypes[0], deterministic=True, **kwargs)
    q, k, v, dout = numerics.random_qkv(0, 2, seq_q, seq_k, 8, 2, self.head_dims[0], self.dtypes[0])
    mask = {name: value for name, value in kwargs.items() if name not in ("q_lens", "kv_lens")}
    if "q_lens" in kwargs:
      mask.update(query_seq_lengths=kwargs["q_lens"], key_value_seq_lengths=kwargs["kv_lens"])
    for _ in range(self.deterministic_repeats):
      again = run_attention(q, k, v, dout, self.implementation, deterministic=True, **mask)
      chex.assert_trees_all_equal(first, again)

  @pytest.mark.parametrize("masked", [True, False], ids=["window", "full"])
  def test_deterministic_backward_at_every_head_dim(self, head_dim, masked):
    # The deterministic backward of each head dim's kernels (on Hopper the
    # split-head-dim ones at 192 and 256 differ most), in both orders of
    # turns (masked, and rotated without a mask).
    kw = dict(causal=True, window=(150, None)) if masked else {}
    q, k, v, dout = numerics.random_qkv(16, 2, 257, 257, 4, 2, head_dim, self.dtypes[0])
    first = self.check(seq_q=257, seq_k=257, head_dim=head_dim, dtype=self.dtypes[0],
                       deterministic=True, seed=16, **kw)
    for _ in range(4):
      again = run_attention(q, k, v, dout, self.implementation, deterministic=True, **kw)
      chex.assert_trees_all_equal(first, again)

  @pytest.mark.parametrize("seq_k", [4500, 9000], ids=["key-groups", "unrotated"])
  @pytest.mark.parametrize("dims", [(192, 128), (256, 256)], ids=["192-128", "256"])
  def test_deterministic_backward_over_many_keys(self, seq_k, dims):
    # Without a mask, Hopper's deterministic kernels rotate the turns among
    # KV tiles resident at once; on 132 SMs, 4500 keys split each head's
    # tiles into two groups with dQ accumulators of their own, and 9000
    # would take three, more than the kernels rotate, which keeps the
    # unrotated order. The second batch entry sees fewer keys, so its groups
    # are smaller.
    head_dim, head_dim_v = dims
    kv_lens = jnp.array([seq_k, seq_k - 1100], jnp.int32)
    kw = dict(batch=2, seq_q=70, seq_k=seq_k, heads_q=2, heads_kv=1, head_dim=head_dim,
              head_dim_v=head_dim_v, dtype=self.dtypes[0], deterministic=True, seed=21)
    first = self.check(kv_lens=kv_lens, **kw)
    q, k, v, dout = numerics.random_qkv(21, 2, 70, seq_k, 2, 1, head_dim, self.dtypes[0], head_dim_v)
    for _ in range(2):
      again = run_attention(q, k, v, dout, self.implementation, deterministic=True,
                            key_value_seq_lengths=kv_lens)
      chex.assert_trees_all_equal(first, again)

  def test_lse_gradient(self):
    q, k, v, _ = numerics.random_qkv(4, 1, 50, 70, 2, 1, self.head_dims[0], self.dtypes[0])

    def loss(impl):
      def f(q, k, v):
        out, lse = jax_flash.attention(q, k, v, causal=True, return_lse=True, implementation=impl)
        return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
      return f

    grad = lambda impl: jax.jit(jax.grad(loss(impl), (0, 1, 2)))  # one program, not op by op
    got = grad(self.implementation)(q, k, v)
    with jax.enable_x64(True):
      q64, k64, v64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v))
      ref = grad("xla")(q64, k64, v64)
    naive = grad("xla")(q, k, v)
    for name, g, r, n in zip(("dq", "dk", "dv"), got, ref, naive):
      numerics.assert_within_tolerance(name, np.asarray(g, np.float32), r,
                                       np.asarray(n, np.float32), self.dtypes[0])

  def test_vmap_matches_loop(self):
    q, k, v, _ = numerics.random_qkv(5, 2, 33, 47, 4, 2, self.head_dims[0], self.dtypes[0])
    stack = lambda x: jnp.stack([x, x[::-1] * 0.5])
    f = lambda q, k, v: jax_flash.attention(q, k, v, causal=True,
                                            implementation=self.implementation)
    batched = jax.jit(jax.vmap(f))(stack(q), stack(k), stack(v))
    for i in range(2):
      chex.assert_trees_all_close(batched[i], f(stack(q)[i], stack(k)[i], stack(v)[i]),
                                  atol=0, rtol=0)

  @pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
  def test_vmap_gradients_match_loop(self, head_dim, deterministic):
    # vmap puts its axis in front of every kernel buffer, dQ's scratch too
    # (its chains and, on Hopper, its query tiles).
    q, k, v, _ = numerics.random_qkv(7, 2, 70, 70, 2, 2, head_dim, self.dtypes[0])
    stack = lambda x: jnp.stack([x, x[::-1] * 0.5])
    loss = lambda q, k, v: jnp.sum(jax_flash.attention(
        q, k, v, deterministic=deterministic, implementation=self.implementation).astype(jnp.float32) ** 2)
    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    batched = jax.jit(jax.vmap(grad))(stack(q), stack(k), stack(v))
    for i in range(2):
      looped = grad(stack(q)[i], stack(k)[i], stack(v)[i])
      chex.assert_trees_all_close([np.asarray(g[i], np.float32) for g in batched],
                                  [np.asarray(g, np.float32) for g in looped], atol=2e-2, rtol=2e-2)

  def test_checkpoint_gradients_equal(self):
    q, k, v, _ = numerics.random_qkv(6, 1, 64, 64, 2, 2, self.head_dims[0], self.dtypes[0])
    f = lambda q, k, v: jnp.sum(jax_flash.attention(
        q, k, v, implementation=self.implementation).astype(jnp.float32) ** 2)
    plain = jax.jit(jax.grad(f, (0, 1, 2)))(q, k, v)
    remat = jax.jit(jax.grad(jax.checkpoint(f), (0, 1, 2)))(q, k, v)
    if self.deterministic_backward:
      chex.assert_trees_all_equal(plain, remat)
    else:
      chex.assert_trees_all_close(plain, remat, atol=1e-2, rtol=1e-2)

  @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
  def test_dot_product_attention_matches_jax_nn(self, causal):
    q, k, v, _ = numerics.random_qkv(7, 2, 96, 96, 4, 2, self.head_dims[0], self.dtypes[0])
    lens = jnp.array([96, 80], jnp.int32)  # every row keeps a key: jax.nn averages empty rows
    kwargs = dict(is_causal=causal, local_window_size=(20, 10) if causal else None,
                  key_value_seq_lengths=lens)
    flash = "flash" if self.implementation != "xla" else None
    got = jax_flash.dot_product_attention(q, k, v, implementation=flash, **kwargs)
    want = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    with jax.enable_x64(True):
      ref = jax.nn.dot_product_attention(*(jnp.asarray(np.asarray(x, np.float64))
                                           for x in (q, k, v)), implementation="xla", **kwargs)
    numerics.assert_within_tolerance("out", np.asarray(got, np.float32), ref,
                                     np.asarray(want, np.float32), self.dtypes[0])

  @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
  def test_packed_documents(self, causal):
    ids = packed_segment_ids(8, batch=2, seq=300, num_docs=5, padding=13)
    out, lse, dq, dk, dv = self.check(seq_q=300, seq_k=300, segment_ids=ids, causal=causal,
                                      window=(None, None) if causal else (60, None),
                                      dtype=self.dtypes[0])
    # Queries and keys of the padding (id -1 on both sides) see each other.
    assert np.all(np.isfinite(lse[:, :, -13:]))

  @pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
  def test_long_and_interleaved_documents(self, causal):
    # Documents longer than a kernel tile (tiles inside one document skip the
    # id comparison) and document 0 resuming after document 1 (its rows'
    # bounds then cover document 1's tiles, which must stay hidden).
    row = np.concatenate([np.full(n, doc) for doc, n in ((0, 200), (1, 261), (0, 150), (2, 90))])
    ids = np.stack([row, np.zeros_like(row)]).astype(np.int32)
    self.check(seq_q=701, seq_k=701, segment_ids=jnp.asarray(ids), causal=causal,
               dtype=self.dtypes[0])

  def test_cross_segments_and_padding_queries(self):
    q_ids = packed_segment_ids(9, batch=2, seq=120, num_docs=4, padding=7)
    kv_ids = packed_segment_ids(10, batch=2, seq=200, num_docs=4, padding=0)
    out, lse, dq, dk, dv = self.check(seq_q=120, seq_k=200, segment_ids=(q_ids, kv_ids),
                                      dtype=self.dtypes[0])
    # Padding queries (id -1) match no key: zero output and gradient.
    assert np.all(out[:, -7:] == 0) and np.all(dq[:, -7:] == 0)
    assert np.all(np.isneginf(lse[:, :, -7:]))

  def test_documents_are_independent(self):
    ids = packed_segment_ids(11, batch=1, seq=256, num_docs=4)
    q, k, v, dout = numerics.random_qkv(12, 1, 256, 256, 4, 2, self.head_dims[0], self.dtypes[0])
    # The deterministic backward makes dQ's order of additions fixed too.
    first = run_attention(q, k, v, dout, self.implementation, causal=True, segment_ids=ids,
                          deterministic=True)
    changed = ids[0] == 2
    bump = lambda x: jnp.where(changed[None, :, None, None], x * 2 + 1, x)
    second = run_attention(bump(q), bump(k), bump(v), bump(dout), self.implementation,
                           causal=True, segment_ids=ids, deterministic=True)
    keep = ~np.asarray(changed)
    names = ("out", "lse", "dq", "dk", "dv")
    for name, a, b in zip(names, first, second):
      token_axis = 2 if a.ndim == 3 else 1  # lse is [B, N, T]
      chex.assert_trees_all_equal(np.compress(keep, a, axis=token_axis),
                                  np.compress(keep, b, axis=token_axis))

  def test_varlen_matches_separate_documents(self):
    offsets = [0, 37, 38, 200, 310]
    total = 330  # 20 tokens of padding past the last document
    q, k, v, _ = numerics.random_qkv(13, 1, total, total, 4, 2, self.head_dims[0], self.dtypes[0])
    packed = jax_flash.varlen_attention(q[0], k[0], v[0], jnp.array(offsets, jnp.int32),
                                        causal=True, implementation=self.implementation)
    for start, end in zip(offsets[:-1], offsets[1:]):
      alone = jax_flash.attention(q[:, start:end], k[:, start:end], v[:, start:end], causal=True,
                                  implementation=self.implementation)
      chex.assert_trees_all_close(packed[start:end], alone[0], atol=1e-2 if
                                  self.dtypes[0] != jnp.float32 else 1e-5, rtol=1e-2)
    assert np.all(np.asarray(packed[offsets[-1]:]) == 0)

  # NaN semantics (issue 45): a NaN or Inf reaches exactly the query rows
  # that see it; nothing a row does not see reaches its out, lse or
  # gradients, nor the gradients of the keys it sees.

  def _poisoned_pair(self, *, batch=2, seq_q=150, seq_k=170, heads_q=4, heads_kv=2,
                     head_dim=None, dtype=None, bad_q=None, bad_k=None, seed=30, **kwargs):
    """(clean, poisoned results, visibility) of one problem, its bad_q query
    rows (q and dout) and bad_k key rows (k and v) poisoned."""
    head_dim = head_dim or self.head_dims[0]
    dtype = dtype or self.dtypes[0]
    q, k, v, dout = numerics.random_qkv(seed, batch, seq_q, seq_k, heads_q, heads_kv, head_dim,
                                        dtype)
    options = {name: kwargs[name] for name in ("causal", "window", "segment_ids", "deterministic")
               if name in kwargs}
    lengths = dict(query_seq_lengths=kwargs.get("q_lens"),
                   key_value_seq_lengths=kwargs.get("kv_lens"))
    clean = run_attention(q, k, v, dout, self.implementation, **options, **lengths)
    bad_q = np.zeros((batch, seq_q), bool) if bad_q is None else bad_q
    bad_k = np.zeros((batch, seq_k), bool) if bad_k is None else bad_k
    poisoned = run_attention(poison(q, bad_q, seed), poison(k, bad_k, seed + 1),
                             poison(v, bad_k, seed + 2), poison(dout, bad_q, seed + 3),
                             self.implementation, **options, **lengths)
    visible = visibility(batch, seq_q, seq_k, **mask_kwargs(
        seq_q, seq_k, kwargs.get("causal", False), kwargs.get("window"), kwargs.get("q_lens"),
        kwargs.get("kv_lens"), kwargs.get("segment_ids")))
    return clean, poisoned, visible, bad_q, bad_k

  @pytest.mark.parametrize("case", ["past-lengths", "decode-past-lengths", "rows-without-keys",
                                    "padding-documents", "other-documents", "outside-window",
                                    "interleaved-documents"])
  def test_masked_nan_and_inf_never_reach_results(self, case):
    self._check_masked_case(case)

  @pytest.mark.parametrize("case", ["padding-documents", "other-documents", "interleaved-documents"])
  def test_masked_nan_and_inf_on_the_fallback_kernels(self, case):
    # The GPU's sm80 kernels also run on Hopper, for what its own do not
    # serve: float16 packed documents at head dim 128 (forward) and a
    # deterministic backward with packed documents.
    if self.implementation != "gpu":
      pytest.skip("the GPU's sm80 kernels")
    if jnp.float16 not in self.dtypes or 128 not in self.head_dims:
      pytest.skip("float16 at head dim 128 is not served here")
    self._check_masked_case(case, dtype=jnp.float16, head_dim=128, deterministic=True)

  def _check_masked_case(self, case, **options):
    batch, seq_q, seq_k = 2, 150, 170
    bad_q, bad_k = np.zeros((batch, seq_q), bool), np.zeros((batch, seq_k), bool)
    kw = {}
    if case == "decode-past-lengths":
      # Unused cache slots; GQA heads packed into one tile (head_packing.py).
      seq_q = 3
      bad_q = np.zeros((batch, seq_q), bool)
      kw = dict(kv_lens=jnp.array([40, 170], jnp.int32), causal=True, heads_q=8, heads_kv=2)
      bad_k[0, 40:] = True
    elif case == "past-lengths":
      kw = dict(q_lens=jnp.array([150, 61], jnp.int32), kv_lens=jnp.array([101, 170], jnp.int32),
                causal=True)
      bad_q[1, 61:] = True
      bad_k[0, 101:] = True
    elif case == "rows-without-keys":
      seq_q = 230  # bottom-right causal: the first 60 query rows see no key
      bad_q = np.zeros((batch, seq_q), bool)
      bad_q[:, :60] = True
      kw = dict(causal=True)
    elif case == "padding-documents":
      # Query padding (id -1) and a key document no query has (id 9).
      q_ids = packed_segment_ids(31, batch, seq_q, num_docs=3, padding=20)
      kv_ids = np.asarray(packed_segment_ids(32, batch, seq_k, num_docs=3)).copy()
      kv_ids[:, 140:] = 9
      kw = dict(segment_ids=(q_ids, jnp.asarray(kv_ids)))
      bad_q[:, -20:] = True
      bad_k[:, 140:] = True
    elif case in ("other-documents", "interleaved-documents"):
      seq_q = seq_k = 170
      bad_q = np.zeros((batch, seq_q), bool)
      if case == "other-documents":
        ids = np.asarray(packed_segment_ids(33, batch, seq_q, num_docs=4))
      else:  # ids drawn per token: documents that share every kernel tile
        ids = np.random.default_rng(34).integers(0, 3, (batch, seq_q)).astype(np.int32)
      bad_q = bad_k = ids == 1  # one whole document poisoned
      kw = dict(segment_ids=jnp.asarray(ids), causal=True)
    else:  # keys outside some rows' windows
      bad_k[:, 80:84] = True
      kw = dict(window=(30, 10))
    clean, poisoned, visible, bad_q, bad_k = self._poisoned_pair(
        batch=batch, seq_q=seq_q, seq_k=seq_k, bad_q=bad_q, bad_k=bad_k, **kw, **options)
    dq_exact = self.deterministic_backward or options.get("deterministic", False)
    reached = assert_unaffected_equal(clean, poisoned, visible, bad_q, bad_k, dq_exact)
    if case in ("other-documents", "interleaved-documents", "outside-window"):
      assert reached.any() and not reached.all()
      # The rows that see a poisoned position output NaN or Inf.
      assert not np.isfinite(poisoned[0][reached]).all(axis=(-2, -1)).any()
    else:
      assert not reached.any()

  @pytest.mark.parametrize("where", ["q", "k", "v-inf", "overflow"])
  def test_visible_nan_and_inf_propagate(self, where):
    # One entry poisoned where some rows see it: those rows' outputs are not
    # finite (and their lse NaN for a logit), everything else as it was.
    batch, seq, heads_q, heads_kv = 1, 130, 4, 2
    head_dim, dtype = self.head_dims[0], self.dtypes[0]
    q, k, v, dout = numerics.random_qkv(35, batch, seq, seq, heads_q, heads_kv, head_dim, dtype)
    kw = dict(causal=True, window=(40, None))
    clean = run_attention(q, k, v, dout, self.implementation, **kw)
    row, key = 90, 70
    if where == "q":
      q = q.at[0, row, 1, 3].set(jnp.nan)
    elif where == "k":
      k = k.at[0, key, 0, 5].set(jnp.nan)
    elif where == "v-inf":
      v = v.at[0, key, 0, 5].set(jnp.inf)
    else:  # a finite q whose logits overflow float32
      q = q.at[0, row, 1].set(jnp.asarray(jnp.finfo(dtype).max / 4, dtype))
    out, lse = run_attention(q, k, v, dout, self.implementation, **kw)[:2]
    visible = visibility(batch, seq, seq, **mask_kwargs(seq, seq, **kw))[0]
    expected = np.zeros((seq, heads_q), bool)  # rows x heads reached
    if where in ("q", "overflow"):
      expected[row, 1] = True
    else:
      expected[visible[:, key], :2] = True  # query heads 0 and 1 share kv head 0
    reached_out = ~np.isfinite(out).all(axis=-1)[0] if where != "v-inf" else ~np.isfinite(
        out[0, :, :, 5])
    np.testing.assert_array_equal(reached_out, expected)
    lse_nan = np.isnan(lse[0]).T
    np.testing.assert_array_equal(lse_nan, expected if where != "v-inf" else False)
    np.testing.assert_array_equal(out[0][~expected], clean[0][0][~expected])
