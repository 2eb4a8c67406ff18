"""Who adds the attention sinks: the Hopper forward kernel in its epilogue
where it serves a call whole, ``_sinks.add_sinks`` after every other call
(``_ffi.kernel_applies_sinks``, docs/numerics.md "Attention sinks"). The
values themselves are the shared specification's (tests/attention_sinks.py),
which every backend class runs."""

import re

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _ffi as ffi


def _problem(batch=2, seq_q=113, seq_k=241, heads_q=8, heads_kv=2, head_dim=64, segments=0):
  q = jax.ShapeDtypeStruct((batch, seq_q, heads_q, head_dim), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((batch, seq_k, heads_kv, head_dim), jnp.bfloat16)
  q_ids = jax.ShapeDtypeStruct((batch, segments), jnp.int32)
  return q, k, k, q_ids


def _call(problem, backend="gpu", causal=True, **kw):
  """A bottom-right causal (or unmasked) call on the problem's shapes."""
  q, k = problem[:2]
  return ffi.KernelCall(backend=backend, scale=0.125, diag_offset=k.shape[1] - q.shape[1],
                        window_left=-1, window_right=0 if causal else -1, **kw)


@pytest.fixture
def on_hopper(monkeypatch):
  """The plan as it runs on an H100 with every sm90 forward variant."""
  monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: (9, 0))
  monkeypatch.setattr(ffi, "_sm90_forward_has_variant", lambda *args: True)


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
  assert ffi.kernel_applies_sinks(*problem, call) == applies


def test_no_sinks_without_hopper_kernels(monkeypatch):
  monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: (8, 0))
  problem = _problem()
  assert not ffi.kernel_applies_sinks(*problem, _call(problem))


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
