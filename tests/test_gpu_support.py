"""Which GPUs get the CUDA kernels (jax_flash/_gpu_support.py), with the
compute capability mocked: 8.x and 9.0 run them; every other GPU (Blackwell
10.x / 12.x, pre-Ampere) is routed to XLA with implementation=None and
refused, naming the GPU, with implementation="flash" -- never a launch of
kernels whose machine code that GPU cannot load."""

import re

import jax.numpy as jnp
import pytest

from jax_flash import _gpu_support, api, ffi, validation

SHAPES = validation.Shapes(batch=1, seq_q=128, seq_k=128, heads_q=2, heads_kv=2, head_dim=128,
                           head_dim_v=128)


@pytest.mark.parametrize("capability", [(8, 0), (8, 6), (8, 7), (8, 9), (9, 0)])
def test_ampere_ada_hopper_run_the_kernels(capability):
  assert _gpu_support.capability_unsupported_reason(capability, "some GPU") is None


@pytest.mark.parametrize("capability, kind", [
    ((10, 0), "NVIDIA B200"), ((10, 3), "NVIDIA B300"), ((12, 0), "NVIDIA GeForce RTX 5090"),
    ((12, 1), "NVIDIA GB10"), ((7, 5), "Tesla T4"), ((7, 0), "Tesla V100-SXM2-16GB")])
def test_other_gpus_are_named(capability, kind):
  reason = _gpu_support.capability_unsupported_reason(capability, kind)
  assert reason == ("the GPU kernels are compiled for compute capability 8.x (sm_80) and 9.0 "
                    f"(sm_90a); {kind} has compute capability {capability[0]}.{capability[1]}")


@pytest.fixture
def gpu(monkeypatch):
  """Pretends that the CUDA kernels are installed and that the first GPU
  has the capability and name the test sets."""
  monkeypatch.setattr(ffi, "cuda_kernels_available", lambda: True)

  def set_gpu(capability, kind):
    monkeypatch.setattr(ffi, "gpu_compute_capability", lambda: capability)
    monkeypatch.setattr(_gpu_support, "gpu_device_kind", lambda: kind)
  return set_gpu


def test_unavailable_reason(gpu, monkeypatch):
  gpu((10, 0), "NVIDIA B200")
  assert "NVIDIA B200 has compute capability 10.0" in _gpu_support.gpu_unavailable_reason()
  gpu((8, 6), "NVIDIA GeForce RTX 3090")
  assert _gpu_support.gpu_unavailable_reason() is None
  gpu(None, None)
  assert _gpu_support.gpu_unavailable_reason() == "no CUDA GPU is visible to JAX"
  monkeypatch.setattr(ffi, "cuda_kernels_available", lambda: False)
  assert _gpu_support.gpu_unavailable_reason().startswith("this installation holds no CUDA kernels")


def test_routing(gpu):
  if api._gpu_unavailable_reason is not _gpu_support.gpu_unavailable_reason:
    pytest.skip("jax_flash/api.py does not route through _gpu_support yet (issue 48's hook)")
  gpu((12, 0), "NVIDIA GeForce RTX 5090")
  assert api.select_backend(None, "gpu", jnp.bfloat16, SHAPES) == "xla"
  for implementation in ("flash", "gpu"):
    with pytest.raises(NotImplementedError, match=re.escape(
        f"implementation={implementation!r}: the GPU kernels are compiled for compute capability "
        "8.x (sm_80) and 9.0 (sm_90a); NVIDIA GeForce RTX 5090 has compute capability 12.0")):
      api.select_backend(implementation, "gpu", jnp.bfloat16, SHAPES)
  for capability in ((8, 0), (8, 9), (9, 0)):
    gpu(capability, "a supported GPU")
    assert api.select_backend(None, "gpu", jnp.bfloat16, SHAPES) == "gpu"
    assert api.select_backend("flash", "gpu", jnp.bfloat16, SHAPES) == "gpu"
