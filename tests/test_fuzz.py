"""Shape fuzzing of the CPU kernels with hypothesis (slow: each example compiles)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from attention_base import AttentionTestBase

window_side = st.one_of(st.none(), st.integers(0, 40))


class FuzzCpu(AttentionTestBase):
  implementation = "cpu"


@pytest.mark.slow
@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    batch=st.integers(1, 2),
    seq_q=st.integers(1, 90),
    seq_k=st.integers(1, 90),
    heads_kv=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 24, 64, 72]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
    causal=st.booleans(),
    window=st.one_of(st.none(), st.tuples(window_side, window_side)),
    seed=st.integers(0, 2**16),
)
def test_cpu_kernels_match_reference(batch, seq_q, seq_k, heads_kv, group, head_dim, dtype,
                                     causal, window, seed):
  FuzzCpu().check(batch=batch, seq_q=seq_q, seq_k=seq_k, heads_q=heads_kv * group,
                  heads_kv=heads_kv, head_dim=head_dim, dtype=dtype, causal=causal, window=window,
                  seed=seed)
