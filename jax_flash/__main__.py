"""python -m jax_flash: check the kernels on this machine, then time them.

Checks forward and backward of the default backend against a float32
reference on a few awkward shapes, then prints a short benchmark table of
jax_flash beside the other implementations JAX offers on this device.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import benchmark, reference

from tqdm import tqdm

CHECKS = [  # (batch, seq_q, seq_k, heads_q, heads_kv, head_dim, causal)
    (2, 17, 17, 4, 4, 64, False),
    (1, 130, 257, 8, 2, 128, True),
    (2, 1000, 1000, 2, 1, 64, True),
]


def check(dtype) -> list[str]:
  failures = []
  for case in tqdm(CHECKS, desc=f"checking {jnp.dtype(dtype).name}", leave=False):
    batch, seq_q, seq_k, heads_q, heads_kv, head_dim, causal = case
    keys = jax.random.split(jax.random.key(seq_q), 4)
    q = jax.random.normal(keys[0], (batch, seq_q, heads_q, head_dim), dtype)
    k = jax.random.normal(keys[1], (batch, seq_k, heads_kv, head_dim), dtype)
    v = jax.random.normal(keys[2], (batch, seq_k, heads_kv, head_dim), dtype)

    def loss(q, k, v, impl):
      return jnp.sum(jnp.sin(jax_flash.attention(q, k, v, causal=causal,
                                                 implementation=impl).astype(jnp.float32)))

    got = jax.jit(jax.value_and_grad(loss, (0, 1, 2)), static_argnums=3)(q, k, v, "flash")
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    want = jax.jit(jax.value_and_grad(loss, (0, 1, 2)), static_argnums=3)(*up, "xla")
    errors = [float(jnp.max(jnp.abs(a - b))) / max(float(jnp.max(jnp.abs(b))), 1.0)
              for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
    limit = 1e-4 if dtype == jnp.float32 else 5e-2
    if max(errors) > limit or not np.isfinite(errors).all():
      failures.append(f"{case} {jnp.dtype(dtype).name}: relative error {max(errors):.2e}")
  return failures


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_flash", description=__doc__.splitlines()[0])
  parser.add_argument("--no-bench", action="store_true", help="only run the correctness checks")
  args = parser.parse_args(argv)

  device = jax.devices()[0]
  print(f"jax_flash {jax_flash.__version__} | jax {jax.__version__} | {device.platform}: "
        f"{device.device_kind} | CUDA kernels built: {jax_flash.cuda_kernels_available()}")
  on_gpu = device.platform == "gpu"
  dtypes = (jnp.bfloat16, jnp.float16) if on_gpu else (jnp.float32, jnp.bfloat16)
  failures = [f for dtype in dtypes for f in check(dtype)]
  if failures:
    print("FAILED:\n  " + "\n  ".join(failures))
    return 1
  print(f"correctness: forward and backward match the float32 reference ({len(CHECKS)} shapes x "
        f"{len(dtypes)} dtypes)")
  if args.no_bench:
    return 0

  if on_gpu:
    configs = [benchmark.Config(2, 8192, 16, 128, causal) for causal in (False, True)]
    impls = ("jax_flash", "cudnn")
  else:
    configs = [benchmark.Config(1, 1024, 8, 64, causal) for causal in (False, True)]
    impls = ("jax_flash", "xla")
  results = {}
  for config in tqdm(configs, desc="benchmark"):
    for impl in impls:
      results[impl, config] = benchmark.measure(impl, config, iters=10 if on_gpu else 2)
  anchor = impls[1]
  unit, factor = ("TFLOPS", 1.0) if on_gpu else ("GFLOPS", 1e3)
  print(f"\n{'config':<26}{'impl':<11}{'fwd ' + unit:>12}{'bwd ' + unit:>12}{'fwd x':>7}{'bwd x':>7}")
  for config in configs:
    name = f"B{config.batch} S{config.seq} N{config.heads} H{config.head_dim}" + (
        " causal" if config.causal else "")
    base = results[anchor, config]
    for impl in impls:
      r = results[impl, config]
      print(f"{name:<26}{impl:<11}{r['fwd_tflops'] * factor:>12.1f}{r['bwd_tflops'] * factor:>12.1f}"
            f"{r['fwd_tflops'] / base['fwd_tflops']:>7.2f}{r['bwd_tflops'] / base['bwd_tflops']:>7.2f}")
  print(f"(ratios against {anchor}, bf16, in this process)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
