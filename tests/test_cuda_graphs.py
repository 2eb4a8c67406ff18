"""The CUDA handlers run correctly when XLA captures them into command buffers
(CUDA graphs). Runs in a subprocess because XLA reads its flags once."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import jax_flash

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 300, 8, 128), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, 300, 2, 128), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, 300, 2, 128), jnp.bfloat16)

    def step(q, k, v):
        def loss(q, k, v):
            return jnp.sum(jax_flash.attention(q, k, v, causal=True,
                                               implementation="gpu").astype(jnp.float32) ** 2)
        return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

    compiled = jax.jit(step).lower(q, k, v).compile()
    hlo = compiled.as_text()
    # Computations are separated by blank lines; XLA names the ones it
    # records as CUDA graphs "command_buffer...".
    graphs = [block for block in hlo.split("\n\n")
              if block.lstrip().lstrip("%").startswith("command_buffer")]
    for target in ("jax_flash_gpu_fwd_v1", "jax_flash_gpu_bwd_v1"):
        assert any(target in block for block in graphs), (target, hlo[-4000:])
    results = [jax.tree.map(np.asarray, compiled(q, k, v)) for _ in range(3)]
    print("RESULT", float(results[0][0]), float(np.abs(results[0][1][0]).sum()))
    for again in results[1:]:
        assert np.array_equal(results[0][0], again[0])
""")


def run(flags: str) -> str:
  env = dict(os.environ, XLA_FLAGS=flags)
  proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return next(line for line in proc.stdout.splitlines() if line.startswith("RESULT"))


@pytest.mark.gpu
def test_handlers_run_inside_command_buffers():
  graphs = run("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
               "--xla_gpu_graph_min_graph_size=1")
  # The forward is deterministic; the captured run matches a plain one.
  plain = run("--xla_gpu_enable_command_buffer=")
  assert graphs.split()[1] == plain.split()[1]
