"""GPU time per kernel of one forward + backward step, jax_flash beside the
anchors, from JAX's profiler (CUPTI): which kernels a step launches and how
long each runs, without the host time between them that a wall-clock timing
includes.

    python scripts/kernel_times.py --impls jax_flash cudnn --head-dims 64 128 256 \\
        --seq 8192 --out kernel_times.json
"""

import argparse
import collections
import glob
import json
import pathlib
import sys
import tempfile

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jax_flash import _benchmark as benchmark  # noqa: E402


def kernel_times(impl: str, config: benchmark.Config, steps: int) -> dict:
  """Microseconds per step of every GPU activity (kernel, memset, copy)."""
  q, k, v, dout = benchmark.inputs(config)
  attend = benchmark.attention_fn(impl, config)

  @jax.jit
  def step(q, k, v, dout):
    _, pullback = jax.vjp(attend, q, k, v)
    return pullback(dout)

  jax.block_until_ready(step(q, k, v, dout))
  trace_dir = tempfile.mkdtemp()
  jax.profiler.start_trace(trace_dir)
  for _ in range(steps):
    result = step(q, k, v, dout)
  jax.block_until_ready(result)
  jax.profiler.stop_trace()
  profile = jax.profiler.ProfileData.from_file(
      glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0])
  times = collections.defaultdict(float)
  for plane in profile.planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    for line in plane.lines:
      if "stream" in line.name.lower():
        for event in line.events:
          times[event.name] += event.duration_ns / 1e3 / steps
  return dict(sorted(times.items(), key=lambda item: -item[1]))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impls", nargs="+", default=["jax_flash", "cudnn"],
                      choices=benchmark.IMPLEMENTATIONS)
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--out", type=pathlib.Path, help="JSON file to write")
  args = parser.parse_args(argv)
  report = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "steps": args.steps,
            "config": dict(seq=args.seq, tokens=args.tokens, heads=args.heads, causal=args.causal),
            "microseconds_per_step": {}}
  for impl in args.impls:
    for head_dim in args.head_dims:
      config = benchmark.Config(batch=max(args.tokens // args.seq, 1), seq=args.seq, heads=args.heads,
                                head_dim=head_dim, causal=args.causal)
      times = kernel_times(impl, config, args.steps)
      report["microseconds_per_step"][f"{impl} hd{head_dim}"] = times
      print(f"{impl} hd{head_dim}: {sum(times.values()):.1f} us per step")
      for name, us in times.items():
        print(f"  {us:9.1f}  {name[:100]}")
  if args.out:
    args.out.write_text(json.dumps(report, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
