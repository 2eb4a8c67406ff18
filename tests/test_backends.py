"""The shared attention specification, once per backend."""

import jax.numpy as jnp
import pytest

from attention_base import AttentionTestBase


class TestXla(AttentionTestBase):
  implementation = "xla"
  dtypes = (jnp.float32, jnp.bfloat16)
  head_dims = (64, 128)
  long_seq = 1500


class TestCpu(AttentionTestBase):
  implementation = "cpu"
  dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
  head_dims = (64, 40, 96, 128, 256)


@pytest.mark.gpu
class TestGpu(AttentionTestBase):
  implementation = "gpu"
  dtypes = (jnp.bfloat16, jnp.float16)
  head_dims = (64, 96, 128, 192, 256)
  deterministic_backward = False  # dQ is accumulated with fp32 atomics
  sectioned_grid = (2050, 7000)
