"""jax_flash.mla_decode's Hopper kernels (cuda_src/mla_sm90), both cache
formats: test_mla.py's kernel checks, and for the FP8 cache its error against
the unquantised cache, the composition and the FFI handler's own checks
(skipped without a Hopper GPU); on any host, the FP8 cache's CUDA lowering."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
import numerics
from jax_flash import _mla as mla
from mla_kernel_checks import MlaKernelChecks
from test_mla import (BATCHES, LATENT, SCALE, assert_within_fp8_error_of_unquantised, make_batch,
                      naive_fp8, run)


@pytest.mark.gpu
class TestMlaGpu(MlaKernelChecks):
  """The Hopper kernel for the bfloat16 / float16 cache (kernel.py)."""


@pytest.mark.gpu
class TestMlaFp8Gpu(MlaKernelChecks):
  """The Hopper kernel for the FP8 cache (kernel_fp8.py), its queries
  quantised by quantize_latent before the call.

  The rounding floor: the FP8 tensor cores keep about 14 bits when they
  accumulate (DeepSeek-V3's report, section 3.3.2), so the logits' 512-column
  product rounds well above float32, which naive_fp8 (float32 products) does
  not: an emulation of such an accumulator (each 32-column step truncated to
  14 bits) moved the lse of BATCHES by up to 6e-4, above float32's floor
  (3e-5 to 8e-5 at 1000 to 4097 keys). float16's (2^-10, the nearest above 14
  bits: 0.26 to 0.63 on the lse) allows it; bfloat16's (2 to 5 on an lse of at
  most 10) would let no lse error fail. The bfloat16 output needs no floor:
  the composition and the CPU kernel return it too and pass with float32's."""
  dtypes = (jnp.float8_e4m3fn,)
  fp8_floor = jnp.float16

  def test_within_the_measured_fp8_error_of_unquantised(self, dtype):
    for lengths, new in BATCHES:
      inputs, rows = self.batch(len(lengths), lengths, new, dtype)
      assert_within_fp8_error_of_unquantised(self.run(inputs)[0], inputs, rows)

  def test_close_to_the_xla_composition(self, dtype):
    """The composition computes the kernel's maths (fp8_reference); the two
    differ in summation order, in the FP8 tensor cores' accumulation and in
    P codes that a float32 rounding moves across a rounding boundary: within
    the tolerance of the float64 reference's test."""
    inputs, rows = self.batch(40, [1000, 4097, 300], [2, 1, 2], dtype, heads=64)
    got, want = self.run(inputs), run(inputs)
    longest = max(len(r) for r in rows)
    for name, g, w, n in zip(("out", "lse"), got, want, naive_fp8(inputs, rows)):
      numerics.assert_within_tolerance(f"{name} flash vs xla", g, w, n, self.fp8_floor,
                                       reduction=longest)

  def test_handler_validates_buffers(self, dtype):
    """The FFI handler's own checks (mla_ffi.h), reached by calling its
    target with a wrong buffer: an error naming it, no launch."""
    inputs, _ = self.batch(14, [100], [1], dtype)
    q_codes, q_scales, q_rope = mla.quantize_latent(inputs["q"])
    cache = inputs["cache"]
    out_types = (jax.ShapeDtypeStruct((1, 1, 16, LATENT), jnp.bfloat16),
                 jax.ShapeDtypeStruct((1, 1, 16), jnp.float32))
    call = lambda **changes: jax.ffi.ffi_call(mla._CUDA_TARGETS[True], out_types)(
        *{**dict(q_codes=q_codes, q_scales=q_scales, q_rope=q_rope, latent=cache.latent,
                 scales=cache.scales, rope=cache.rope, table=inputs["page_table"],
                 q_lens=inputs["query_lengths"], kv_lens=inputs["cache_lengths"]),
          **changes}.values(), scale=np.float32(SCALE),
        split_pages=np.int32(inputs["page_table"].shape[1]))
    jax.block_until_ready(call())
    for changes, match in [
        (dict(latent=cache.latent[..., :256]), r"latent must be \[num_pages > 0, 64, 512\]"),
        (dict(scales=cache.scales.astype(jnp.bfloat16)), "scales must be float32"),
        (dict(q_codes=q_rope), r"q_codes must be \[batch, s_q, heads > 0, 512\]"),
        (dict(q_rope=q_rope.astype(jnp.float16)), "q_rope must be bfloat16"),
        (dict(q_scales=q_scales[..., :8]), "q_scales has 8 elements, expected 16")]:
      with pytest.raises(Exception, match=match):
        jax.block_until_ready(call(**changes))


def test_fp8_cache_lowers_to_the_hopper_kernel_per_shard(monkeypatch):
  """Exported for CUDA as on a Hopper GPU with both kernels (its checks
  monkeypatched, so that any host runs this): the FP8 cache calls its
  kernel's target with the query quantised (codes, scales, RoPE columns),
  and under an Explicit mesh over heads with each device's 16 of the 128
  heads (one row tile: splits of 1024 keys instead of 2048, which the page
  table's padding to whole splits shows: 33 pages to 64 or 48)."""
  from jax import export
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  if len(jax.devices()) < 8:
    pytest.skip(f"needs 8 devices, {jax.default_backend()} has {len(jax.devices())}")
  monkeypatch.setattr(mla.api, "_platform_of", lambda *arrays: "gpu")
  monkeypatch.setattr(mla, "_CUDA_REGISTERED", {False: True, True: True})
  monkeypatch.setattr(mla.ffi, "gpu_compute_capability", lambda: (9, 0))
  inputs, _ = make_batch(18, [2100, 7], [1, 1], heads=128, fp8=True)
  target = mla._CUDA_TARGETS[True]
  attend = jax.jit(functools.partial(jax_flash.mla_decode, scale=SCALE, implementation="flash"))

  def operand_types(inputs):
    text = export.export(attend, platforms=["cuda"],
                         disabled_checks=[export.DisabledSafetyCheck.custom_call(target)])(
                             **inputs).mlir_module()
    (types,) = re.findall(rf"custom_call @{target}\(.* : \(([^)]*)\) ->", text)
    return types

  pages = inputs["cache"].latent.shape[0]
  cache = (f"tensor<{pages}x64x512xf8E4M3FN>, tensor<{pages}x64xf32>, "
           f"tensor<{pages}x64x64xbf16>")
  assert operand_types(inputs) == (
      f"tensor<2x1x128x512xf8E4M3FN>, tensor<2x1x128xf32>, tensor<2x1x128x64xbf16>, {cache}, "
      "tensor<2x64xi32>, tensor<2xi32>, tensor<2xi32>")
  mesh = jax.make_mesh((8,), ("tp",), axis_types=(AxisType.Explicit,))
  placed = {name: jax.device_put(x, NamedSharding(mesh, P(None, None, "tp") if name == "q"
                                                  else P()))
            for name, x in inputs.items()}
  assert operand_types(placed) == (
      f"tensor<2x1x16x512xf8E4M3FN>, tensor<2x1x16xf32>, tensor<2x1x16x64xbf16>, {cache}, "
      "tensor<2x48xi32>, tensor<2xi32>, tensor<2xi32>")
