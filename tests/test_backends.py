"""The shared attention specification, once per backend.

On a CPU each case costs a few seconds of compiling (the kernel call, the
float64 reference and the naive one), so the quick suite runs one case of
each behaviour on the CPU kernels (``TestCpu``: bfloat16, head dim 64), and
``TestCpuSweep`` (marked slow) runs the whole specification at every dtype
and head dim they serve.
"""

import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import pytest

from jax_flash import _configs as configs

from attention_base import AttentionTestBase


class TestCpu(AttentionTestBase):
  implementation = "cpu"
  dtypes = (jnp.bfloat16,)
  head_dims = (64,)
  deterministic_repeats = 3

  @pytest.mark.parametrize("seq_q,seq_k,causal", [(1, 1, False), (17, 1000, True),
                                                  (1000, 17, True)])
  def test_awkward_lengths(self, seq_q, seq_k, causal):
    super().test_awkward_lengths(seq_q, seq_k, causal)

  def test_smaller_value_head_dim(self, dtype):
    super().test_smaller_value_head_dim(dtype, "causal")

  def test_short_queries_pack_query_heads(self):
    super().test_short_queries_pack_query_heads(1, True)

  def test_grouped_heads(self):
    super().test_grouped_heads(8, 2)

  def test_sliding_window(self):
    super().test_sliding_window((40, 3), True)

  def test_sequence_lengths(self):
    super().test_sequence_lengths(True)

  def test_softcap(self, dtype, head_dim):
    super().test_softcap(dtype, head_dim, True)

  def test_deterministic_backward(self):
    super().test_deterministic_backward("documents")

  def test_vmap_gradients_match_loop(self, head_dim):
    super().test_vmap_gradients_match_loop(head_dim, True)

  def test_dot_product_attention_matches_jax_nn(self):
    super().test_dot_product_attention_matches_jax_nn(True)

  def test_packed_documents(self):
    super().test_packed_documents(True)

  # NaN semantics and sinks: one case each here, every case in TestCpuSweep.
  def test_masked_nan_and_inf_never_reach_results(self):
    super().test_masked_nan_and_inf_never_reach_results("past-lengths")

  def test_visible_nan_and_inf_propagate(self):
    super().test_visible_nan_and_inf_propagate("k")

  def test_sinks_match_reference(self):
    super().test_sinks_match_reference("causal-gqa")

  @pytest.mark.slow
  @pytest.mark.parametrize("isa", ["avx2", "baseline"])
  def test_narrower_instruction_sets(self, isa):
    # The kernels are compiled once per instruction set and run the widest
    # this CPU has; JAX_FLASH_CPU_ISA caps it (read once per process), so a
    # child process checks the narrower copies' tile edges and masks, and
    # the paged kernel's.
    checks = """
import jax.numpy as jnp
from test_backends import TestCpu
from test_paged import TestPagedCpuKernel
cpu = TestCpu()
cpu.check(batch=1, seq_q=17, seq_k=1000, heads_q=2, heads_kv=1, causal=True)
cpu.check(seq_q=113, seq_k=241, head_dim=128, dtype=jnp.float32, window=(40, 3), softcap=1.5)
cpu.check(seq_q=200, seq_k=333, head_dim=192, head_dim_v=128, causal=True, deterministic=True)
TestPagedCpuKernel().test_matches_float64(jnp.bfloat16)
"""
    tests = pathlib.Path(__file__).parent
    env = {**os.environ, "JAX_FLASH_CPU_ISA": isa,
           "PYTHONPATH": os.pathsep.join(filter(None, (str(tests), os.environ.get("PYTHONPATH"))))}
    result = subprocess.run([sys.executable, "-c", checks], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


# Cases of the specification that the quick suite leaves to TestCpuSweep:
# longer sequences, every head dim, more of the same masks.
for _name in ("test_decoding_long_cache", "test_short_queries_with_documents_and_lengths",
              "test_masks_at_every_head_dim", "test_long_rows_of_unequal_reach",
              "test_causal_grid_in_sections", "test_softcap_saturated",
              "test_softcap_with_documents_and_window", "test_deterministic_backward_at_every_head_dim",
              "test_deterministic_backward_over_many_keys", "test_long_and_interleaved_documents"):
  setattr(TestCpu, _name, None)


@pytest.mark.slow
class TestCpuSweep(AttentionTestBase):
  implementation = "cpu"
  dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
  head_dims = (64, 40, 96, 128, 256)


@pytest.mark.slow
class TestXla(AttentionTestBase):
  implementation = "xla"
  dtypes = (jnp.float32, jnp.bfloat16)
  head_dims = (64, 128)
  long_seq = 1500


@pytest.mark.gpu
class TestGpu(AttentionTestBase):
  implementation = "gpu"
  dtypes = (jnp.bfloat16, jnp.float16)
  head_dims = configs.GPU.head_dims
  deterministic_backward = False  # dQ is accumulated with fp32 atomics
  sectioned_grid = (2050, 7000)
