"""Who adds the attention sinks: the Hopper forward kernel in its epilogue
where it serves a call whole, ``_sinks.add_sinks`` after every other call
(``_plan.plan_forward``, docs/numerics.md "Attention sinks"). The
values themselves are the shared specification's (tests/attention_sinks.py),
which every backend class runs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _ffi as ffi, _plan as plan
from jax_flash._call import KernelCall, Mask, MaskOperands
from jax_flash._sinks import add_sinks


def _problem(batch=2, seq_q=113, seq_k=241, heads_q=8, heads_kv=2, head_dim=64, segments=0):
  q = jax.ShapeDtypeStruct((batch, seq_q, heads_q, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((batch, seq_k, heads_kv, head_dim), jnp.bfloat16)
  q_ids = jax.ShapeDtypeStruct((batch, segments), jnp.int32)
  return q, k, k, q_ids


def _call(problem, backend="gpu", causal=True, **kw):
  """A bottom-right causal (or unmasked) call on the problem's shapes."""
  q, k = problem[:2]
  return KernelCall(backend=backend, scale=0.125,
                    mask=Mask(k.shape[1] - q.shape[1], -1, 0 if causal else -1), **kw)


def kernel_adds_sinks(q, k, v, q_ids, call) -> bool:
  """The forward plan's say for a call with sinks on these arrays."""
  lens = jax.ShapeDtypeStruct(q.shape[:1], jnp.int32)
  masks = MaskOperands(lens, lens, q_ids, q_ids, q_ids, q_ids)
  return plan.plan_forward(q, k, v, masks, call, sinks=True).kernel_adds_sinks


@pytest.fixture
def on_hopper(monkeypatch):
  """The plan as it runs on an H100 with every sm90 forward variant."""
  monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(ffi, "sm90_forward_has_variant", lambda *args: True)


@pytest.mark.parametrize("case,applies", [
    ("whole", True),
    ("documents", True),
    ("cpu", False),
    ("xla", False),
    # One decoding query sees every key: the GQA heads pack into one tile's rows.
    ("packed-heads", False),
    # Few query tiles and many keys, every key visible: the keys split.
    ("split-keys", False),
    ("batch-invariant-split", False),
    ("no-keys", False),
    ("grid-limit", False),
])
def test_kernel_applies_sinks_only_where_it_runs_whole(on_hopper, monkeypatch, case, applies):
  problem = {
      "documents": _problem(segments=113),
      "packed-heads": _problem(seq_q=1),
      "split-keys": _problem(batch=1, seq_q=100, seq_k=8192, heads_q=2, heads_kv=2),
      "batch-invariant-split": _problem(batch=1, seq_q=1, seq_k=8192, heads_q=2, heads_kv=2),
      "no-keys": _problem(seq_k=0),
      "grid-limit": _problem(batch=70000),
  }.get(case, _problem())
  call = _call(problem, backend=case if case in ("cpu", "xla") else "gpu",
               causal=case != "split-keys", batch_invariant=case == "batch-invariant-split")
  # The batch-invariant split runs the paged kernel, registered with the CUDA library.
  monkeypatch.setattr(jax_flash._paged, "_CUDA_REGISTERED", True)
  assert kernel_adds_sinks(*problem, call) == applies


def test_no_sinks_without_hopper_kernels(monkeypatch):
  monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: (8, 0))
  problem = _problem()
  assert not kernel_adds_sinks(*problem, _call(problem))


@pytest.mark.gpu
def test_hopper_forward_gets_the_sinks():
  """On Hopper the lowered call hands the sinks to the v3 forward target,
  [batch, heads_q, 1], and adds nothing after it (add_sinks' sigmoid)."""
  if ffi.gpu_compute_capability()[0] != 9:
    pytest.skip("only the Hopper forward kernel adds the sinks")
  q = jnp.zeros((2, 113, 8, 64), jnp.bfloat16)
  k = v = jnp.zeros((2, 241, 2, 64), jnp.bfloat16)

  def attend(q, k, v, sinks):
    return jax_flash.attention(q, k, v, causal=True, sinks=sinks, implementation="gpu")

  text = jax.jit(attend).lower(q, k, v, jnp.zeros(8, jnp.float32)).as_text()
  assert re.search(r"custom_call @jax_flash_gpu_fwd_v3\(.*tensor<2x8x1xf32>\) ->", text)
  assert "logistic" not in text


# One per kind of sm90 forward variant: short tiles (hd64), plain (hd96), K / V
# multicast pairs (no window, 4096 queries and up), packed documents, and
# the native 192 / 128 value dims.
KERNEL_CASES = {
    "short": dict(head_dim=64, seq=300, causal=True),
    "plain": dict(head_dim=96, seq=300, causal=False),
    "pair": dict(head_dim=128, seq=4096, causal=False),
    "documents": dict(head_dim=128, seq=300, causal=True, documents=True),
    "192-128": dict(head_dim=192, head_dim_v=128, seq=4100, causal=False),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_kernel_sinks_match_sinks_added_after_the_call(case):
  """The epilogue's sinks against add_sinks on the same kernel's sink-free
  results: a sink of -inf changes no bit of its head, and sinks far above
  every logit (e^200 overflows float32) leave lse = sink and O about 0."""
  if ffi.gpu_compute_capability()[0] != 9:
    pytest.skip("only the Hopper forward kernel adds the sinks")
  kw = KERNEL_CASES[case]
  seq, head_dim = kw["seq"], kw["head_dim"]
  keys = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(keys[0], (2, seq, 8, head_dim), jnp.bfloat16)
  k = jax.random.normal(keys[1], (2, seq, 2, head_dim), jnp.bfloat16)
  v = jax.random.normal(keys[2], (2, seq, 2, kw.get("head_dim_v", head_dim)), jnp.bfloat16)
  sinks = jnp.array([-jnp.inf, -2.0, 0.5, 3.0, 6.0, 9.0, 60.0, 200.0], jnp.float32)
  segment_ids = (jnp.arange(seq)[None] * 3 // seq).repeat(2, 0) if kw.get("documents") else None
  attend = lambda sinks: jax_flash.attention(q, k, v, causal=kw["causal"], sinks=sinks,
                                             segment_ids=segment_ids, return_lse=True,
                                             implementation="gpu")
  q_ids = jnp.zeros((2, seq if segment_ids is not None else 0), jnp.int32)
  call = KernelCall("gpu", head_dim ** -0.5, Mask(0, -1, 0 if kw["causal"] else -1))
  assert kernel_adds_sinks(q, k, v, q_ids, call)
  out_s, lse_s = jax.jit(attend)(sinks)
  out, lse = jax.jit(attend)(None)
  want_out, want_lse = add_sinks(out, lse, sinks)
  np.testing.assert_array_equal(np.asarray(out_s[:, :, 0]), np.asarray(out[:, :, 0]))
  np.testing.assert_array_equal(np.asarray(lse_s[:, 0]), np.asarray(lse[:, 0]))
  np.testing.assert_allclose(np.asarray(lse_s), np.asarray(want_lse), rtol=1e-5, atol=1e-5)
  # O rounds once in the kernel, twice through add_sinks: two bfloat16 ulps.
  np.testing.assert_allclose(np.asarray(out_s, np.float32), np.asarray(want_out, np.float32),
                             rtol=2.0 ** -6, atol=1e-3)
