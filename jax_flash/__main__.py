"""python -m jax_flash: which kernels serve this device, a check of them, a short benchmark.

Says which of jax_flash's kernels this installation holds (built) and which
of them can run here (usable: the GPU kernels need a CUDA GPU of compute
capability 8.0 or newer that JAX sees), and which serve the default device.
Then checks forward and backward of those kernels against the float32 XLA
path on a few awkward shapes, and prints a short table of jax_flash beside
the other implementations JAX offers on this device.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _api as api, _benchmark as benchmark, _configs as configs, _ffi as ffi

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


def kernel_report() -> tuple[list[str], bool]:
  """Lines saying which kernels are built and usable and what serves the
  default device; and whether jax_flash's kernels serve it."""
  device = jax.devices()[0]
  gpu_reason = api._gpu_unavailable_reason()
  capability = ffi.gpu_compute_capability()
  gpu_built = "built" if ffi.cuda_kernels_available() else "not built in this installation"
  gpu_usable = (f"usable (compute capability {capability[0]}.{capability[1]})"
                if gpu_reason is None else f"not usable: {gpu_reason}")
  cpu = configs.BACKENDS["cpu"]
  lines = [
      f"jax_flash {jax_flash.__version__}, jax {jax.__version__}, default device: "
      f"{device.platform} ({device.device_kind})",
      f"  CPU kernels: built, usable ({', '.join(d.name for d in cpu.dtypes)})",
      f"  GPU kernels: {gpu_built}, {gpu_usable}",
  ]
  served = device.platform == "cpu" or (device.platform == "gpu" and gpu_reason is None)
  serving = (f"jax_flash {device.platform.upper()} kernels" if served
             else "XLA: jax_flash has no usable kernels for this device")
  lines.append(f"  serving the default device: {serving}")
  return lines, served


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jax_flash", description=__doc__.splitlines()[0])
  parser.add_argument("--no-bench", action="store_true", help="only run the correctness checks")
  args = parser.parse_args(argv)

  lines, served = kernel_report()
  print("\n".join(lines))
  if not served:
    return 1
  on_gpu = jax.devices()[0].platform == "gpu"
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
