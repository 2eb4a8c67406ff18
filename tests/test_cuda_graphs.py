"""The CUDA handlers run correctly when XLA captures them into command
buffers (CUDA graphs). Runs in subprocesses because XLA reads its flags once.

A replayed graph does not call the handlers, so the handler call counter
tells capture (fewer calls than executions) from plain execution."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(r"""
    import json
    import jax, jax.numpy as jnp, numpy as np
    import jax_flash
    from jax_flash import _ffi as ffi

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 300, 8, 128), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, 300, 2, 128), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, 300, 2, 128), jnp.bfloat16)

    def step(q, k, v):
        def loss(q, k, v):
            out = jax_flash.attention(q, k, v, causal=True, implementation="gpu")
            return jnp.sum(out.astype(jnp.float32) ** 2), out
        return jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v)

    compiled = jax.jit(step).lower(q, k, v).compile()
    runs = 5
    before = ffi.cuda_handler_calls()
    results = [jax.tree.map(np.asarray, jax.block_until_ready(compiled(q, k, v)))
               for _ in range(runs)]
    calls = ffi.cuda_handler_calls() - before
    (_, out), grads = results[0]
    for (_, out_again), _ in results[1:]:
        assert np.array_equal(out, out_again)
    print("RESULT " + json.dumps({"calls": calls, "executions": runs,
                                  "out_sum": float(np.abs(out.astype(np.float32)).sum()),
                                  "dk_sum": float(np.abs(grads[1].astype(np.float32)).sum())}))
""")


def run(flags: str) -> dict:
  env = dict(os.environ, XLA_FLAGS=flags)
  proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
  return json.loads(line[len("RESULT "):])


@pytest.mark.gpu
def test_handlers_replay_from_cuda_graphs():
  plain = run("--xla_gpu_enable_command_buffer=")
  graphs = run("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL "
               "--xla_gpu_graph_min_graph_size=1")
  # Without command buffers XLA calls the forward and backward handler once
  # per execution; with them, recording calls them and replays do not.
  assert plain["calls"] == 2 * plain["executions"], plain
  assert graphs["calls"] < 2 * graphs["executions"], graphs
  # Same inputs, same deterministic forward; dK is deterministic too.
  assert graphs["out_sum"] == plain["out_sum"]
  assert graphs["dk_sum"] == plain["dk_sum"]
