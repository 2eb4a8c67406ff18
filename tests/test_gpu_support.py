"""Which GPUs get the CUDA kernels (jax_flash/_gpu_support.py), with the
compute capability mocked: 8.x and 9.0 run them; every other GPU (Blackwell
10.x / 12.x, pre-Ampere) is routed to XLA with implementation=None and
refused, naming the GPU, with implementation="flash" -- never a launch of
kernels whose machine code that GPU cannot load."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

import jax_flash
from jax_flash import _gpu_support
from jax_flash import _api as api
from jax_flash import _configs as configs
from jax_flash import _ffi as ffi, _kernels as kernels
from jax_flash._call import KernelCall, MaskOperands
from jax_flash import _validation as validation

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
    pytest.skip("jax_flash/_api.py does not route through _gpu_support yet (issue 48's hook)")
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


@pytest.mark.parametrize("capability, direction, head_dim, fits", [
    ((8, 6), "forward", 192, True), ((8, 6), "forward", 256, False),
    ((8, 9), "backward", 64, True), ((8, 9), "backward", 96, False),
    ((8, 0), "forward", 256, True), ((8, 0), "backward", 256, True),
    ((8, 7), "backward", 128, True), ((9, 0), "backward", 256, True)])
def test_shared_memory_per_block(gpu, capability, direction, head_dim, fits):
  # 8.6 / 8.9 give a block 99 KiB: the hd256 forward tile and the backward
  # tiles from hd96 on need more.
  gpu(capability, "NVIDIA L4")
  reason = _gpu_support.shared_memory_reason(capability, direction, head_dim)
  if fits:
    assert reason is None
  else:
    assert reason == (f"the GPU {direction} kernel for head_dim {head_dim} takes "
                      f"{configs.SM80_SHARED_MEMORY[direction][head_dim]} bytes of shared memory "
                      f"per block; NVIDIA L4 (compute capability {capability[0]}.{capability[1]}) "
                      "has 101376")


def test_small_shared_memory_routing(gpu):
  gpu((8, 9), "NVIDIA L4")
  wide = dataclasses.replace(SHAPES, head_dim=256, head_dim_v=256)
  assert api.select_backend(None, "gpu", jnp.bfloat16, wide) == "xla"
  with pytest.raises(NotImplementedError, match="implementation='flash': the GPU forward kernel "
                     "for head_dim 256 takes 131136 bytes"):
    api.select_backend("flash", "gpu", jnp.bfloat16, wide)
  assert api.select_backend("flash", "gpu", jnp.bfloat16, SHAPES) == "gpu"
  # hd128: the forward runs the kernel, the backward cannot.
  x = jnp.zeros((1, 16, 2, 128), jnp.bfloat16)
  loss = lambda implementation: lambda q: jax_flash.attention(
      q, x, x, implementation=implementation).astype(jnp.float32).sum()
  with pytest.raises(NotImplementedError, match="implementation='gpu': the GPU backward kernel "
                     "for head_dim 128 takes 164864 bytes.*implementation=None runs XLA's"):
    jax.make_jaxpr(jax.grad(loss("gpu")))(x)
  call = KernelCall("gpu", 0.1, backward_on_xla=True)
  lens = jnp.full((1,), 16, jnp.int32)
  grads = jax.make_jaxpr(lambda *a: kernels.backward(*a, MaskOperands.build((1,), lens, lens),
                                                     call))(
      x, x, x, x, jnp.zeros((1, 2, 16), jnp.float32), jnp.zeros((1, 2, 16), jnp.float32))
  assert "custom_call" not in str(grads) and "ffi_call" not in str(grads)
