"""jax_flash.mla_decode's CPU kernel (cuda_src/cpu/mla_cpu.cc), both cache
formats: test_mla.py's kernel checks, the default call and exports, head and
batch sharding, and the handler's own checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash
from jax_flash import _mla as mla
from mla_kernel_checks import MlaKernelChecks
from test_mla import SCALE, assert_matches, make_batch, run

COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute")


@pytest.fixture(autouse=True)
def _on_cpu():
  # The kernel is chosen from the platform the call is lowered for.
  if jax.default_backend() != "cpu":
    pytest.skip(f"CPU checks; this process's default backend is {jax.default_backend()}")


class TestMlaCpu(MlaKernelChecks):
  # float16 differs from bfloat16 in its loads and stores only: test_float16.
  dtypes = (jnp.bfloat16, jnp.float8_e4m3fn)

  def test_float16(self):
    self.test_matches_float64(jnp.float16)

  def test_serves_the_default_call(self, dtype):
    inputs, _ = self.batch(15, [40], [1], dtype)
    target = mla._CPU_TARGETS[dtype == jnp.float8_e4m3fn]
    assert target in jax.jit(functools.partial(jax_flash.mla_decode, scale=SCALE)).lower(
        **inputs).as_text()
    for got, want in zip(run(inputs, implementation=None), self.run(inputs)):
      np.testing.assert_array_equal(got, want)

  def test_page_ids_outside_the_pool_read_zeros(self, dtype):
    """Inside jit (no concrete check) a page id outside the pool, negative
    or past its end, reads as a page of zeros, as in the composition."""
    inputs, _ = self.batch(19, [200, 90], [2, 1], dtype, spare_pages=1)
    table = np.asarray(inputs["page_table"])
    spare = sorted(set(range(len(jax.tree.leaves(inputs["cache"])[0]))) - set(table.ravel()))[0]
    cache = jax.tree.map(lambda x: x.at[spare].set(0), inputs["cache"])
    zeros = dict(inputs, cache=cache, page_table=jnp.asarray(table).at[0, 1].set(spare)
                 .at[1, 0].set(spare))
    outside = dict(zeros, page_table=jnp.asarray(table).at[0, 1].set(-7).at[1, 0].set(10 ** 6))
    for got, want in zip(self.run(outside), self.run(zeros)):
      np.testing.assert_array_equal(got, want)

  @pytest.mark.slow
  def test_sweep(self, dtype):
    rng = np.random.default_rng(1)
    for heads in (16, 64, 128):
      for s_q in (1, 2):
        lengths = [int(n) for n in rng.integers(1, 5000, 3)] + [4097]
        new = [int(rng.integers(1, s_q + 1)) for _ in lengths]
        inputs, rows = self.batch(heads + s_q, lengths, new, dtype, heads=heads)
        assert_matches(self.run(inputs), inputs, rows, f"heads {heads} {lengths} {new}")


def test_export_holds_the_kernel_of_each_platform():
  """Exported on this host for CUDA, the module holds the XLA composition (or,
  with "flash", fails to lower) rather than the CPU kernel."""
  from jax import export
  inputs, _ = make_batch(18, [40, 7], [1, 1])
  allow = [export.DisabledSafetyCheck.custom_call(mla._CPU_TARGETS[False])]

  def exported(platforms, implementation=None):
    attend = jax.jit(functools.partial(jax_flash.mla_decode, scale=SCALE,
                                       implementation=implementation))
    return export.export(attend, platforms=platforms, disabled_checks=allow)(
        **inputs).mlir_module()

  assert mla._CPU_TARGETS[False] in exported(["cpu"])
  assert mla._CPU_TARGETS[False] in exported(["cpu", "cuda"])
  assert "custom_call" not in exported(["cuda"])
  with pytest.raises(NotImplementedError, match="an MLA decode call traced without a GPU has "
                                                "no GPU kernel"):
    exported(["cpu", "cuda"], "flash")


@pytest.mark.parametrize("dtype, axes", [
    pytest.param(jnp.bfloat16, "auto", id="bf16-auto"),
    pytest.param(jnp.float8_e4m3fn, "explicit", id="fp8-explicit"),
    pytest.param(jnp.bfloat16, "explicit", id="bf16-explicit", marks=pytest.mark.slow),
    pytest.param(jnp.float8_e4m3fn, "auto", id="fp8-auto", marks=pytest.mark.slow)])
def test_sharded_over_heads_and_batch(dtype, axes):
  """Tensor-parallel MLA on the kernel: heads over one mesh axis and
  sequences (with their table rows and lengths) over another, the cache
  replicated, under plain jit: bitwise the unsharded call, and no collective
  in the compiled program."""
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P
  if len(jax.devices()) < 8:
    pytest.skip(f"needs 8 devices, {jax.default_backend()} has {len(jax.devices())}")
  kind = AxisType.Auto if axes == "auto" else AxisType.Explicit
  mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=(kind, kind))
  inputs, _ = MlaKernelChecks.batch(14, [300, 17], [2, 1], dtype, heads=32)
  specs = {"q": P("dp", None, "tp"), "page_table": P("dp", None), "cache_lengths": P("dp"),
           "query_lengths": P("dp")}
  placed = {name: jax.device_put(x, NamedSharding(mesh, specs.get(name, P())))
            for name, x in inputs.items()}
  out, lse = run(placed, implementation="flash")
  want_out, want_lse = run(inputs, implementation="flash")
  np.testing.assert_array_equal(out, want_out)
  np.testing.assert_array_equal(lse, want_lse)
  attend = jax.jit(functools.partial(jax_flash.mla_decode, scale=SCALE, implementation="flash"))
  compiled = attend.lower(**placed).compile()
  assert compiled.output_shardings.is_equivalent_to(NamedSharding(mesh, specs["q"]), 4)
  assert mla._CPU_TARGETS[dtype == jnp.float8_e4m3fn] in compiled.as_text()
  assert not [c for c in COLLECTIVES if c in compiled.as_text()]


def _hand_built_call(target, q, *pools, table=None, lengths=None, split_pages=None,
                     out_width=512):
  """The kernel's custom call with whatever buffers it is given."""
  batch, s_q, heads = q.shape[:3]
  table = jnp.zeros((batch, 2), jnp.int32) if table is None else table
  lengths = jnp.ones((batch,), jnp.int32) if lengths is None else lengths
  split_pages = table.shape[1] if split_pages is None else split_pages
  rows = batch * (table.shape[1] // split_pages)
  out_types = (jax.ShapeDtypeStruct((rows, s_q, heads, out_width), q.dtype),
               jax.ShapeDtypeStruct((rows, s_q, heads), jnp.float32))
  call = jax.ffi.ffi_call(target, out_types)(
      q, *pools, table, lengths, lengths, scale=np.float32(SCALE),
      split_pages=np.int32(split_pages))
  return jax.block_until_ready(call)


def test_handler_rejects_bad_buffers():
  """Buffers reaching the handlers unchecked (a hand-built call) fail with
  the handler's message, never an abort."""
  q = jnp.zeros((2, 1, 4, 576), jnp.bfloat16)
  cache = jnp.zeros((3, 64, 576), jnp.bfloat16)
  fp8 = mla.empty_mla_cache(3, jnp.float8_e4m3fn)
  plain, quantised = mla._CPU_TARGETS[False], mla._CPU_TARGETS[True]
  cases = [
      ((plain, q, cache[..., :512]), {}, r"cache must be \[num_pages > 0, 64, 576\]"),
      ((plain, q, cache.astype(jnp.float16)), {}, r"cache must be q's dtype"),
      ((plain, q[..., :512], cache), {}, r"q must be \[batch, s_q, heads > 0, 576\]"),
      ((plain, q, cache), {"split_pages": 1}, r"jax_flash_mla_decode_cpu: .* split_pages"),
      ((plain, q, cache), {"lengths": jnp.ones((3,), jnp.int32)},
       r"q_lens has 3 elements, expected 2"),
      ((plain, q, cache), {"out_width": 576}, r"o must have shape \[batch \* splits"),
      ((quantised, q, fp8.latent, fp8.scales.astype(jnp.bfloat16), fp8.rope), {},
       r"scales must be float32"),
      ((quantised, q, fp8.latent, fp8.scales, fp8.rope[:2]), {},
       r"rope must be \[num_pages > 0, 64, 64\] \(num_pages shared\)"),
      ((quantised, q.astype(jnp.float16), *fp8), {}, r"q must be bfloat16"),
  ]
  for args, options, match in cases:
    with pytest.raises(Exception, match=r"jax_flash: " + match):
      _hand_built_call(*args, **options)
