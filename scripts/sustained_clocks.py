"""SM clock, board power and TFLOPS while each implementation runs back to
back for a few seconds, jax_flash beside the anchors: at the board's power
limit an H100 lowers its clock, so a ratio of TFLOPS splits into a ratio of
clocks (energy per cycle) and of TFLOPS per GHz (work per cycle).

    python scripts/sustained_clocks.py --impls jax_flash cudnn --head-dims 64 128 \\
        --ops fwd step --seconds 3 --rounds 2 --out clocks.json

`fwd` times the forward, `step` a forward and backward (their FLOPs summed).
The clock and power are medians of nvidia-smi samples every 50 ms; without
nvidia-smi (no NVIDIA GPU) they are None.
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jax_flash import _benchmark as benchmark  # noqa: E402

SAMPLE_FIELDS = "clocks.sm,power.draw,temperature.gpu"
WARMUP_SECONDS = 0.5  # long enough for the clock to leave its idle boost


def step_fn(impl: str, config: benchmark.Config, op: str):
  """(jitted function, its arguments, FLOPs per call) of one operation."""
  q, k, v, dout = benchmark.inputs(config)
  attend = benchmark.attention_fn(impl, config)
  if op == "fwd":
    return jax.jit(attend), (q, k, v), config.forward_flops()
  step = jax.jit(lambda q, k, v, dout: jax.vjp(attend, q, k, v)[1](dout))
  return step, (q, k, v, dout), config.forward_flops() + config.backward_flops()


def run_for(fn, args, seconds: float) -> int:
  """Calls fn back to back, in groups of five between syncs, for `seconds`."""
  calls, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    for _ in range(5):
      out = fn(*args)
    calls += 5
    jax.block_until_ready(out)
  return calls


def start_sampler():
  try:
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={SAMPLE_FIELDS}", "--format=csv,noheader,nounits",
                             "-lms", "50"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  except FileNotFoundError:
    return None


def stop_sampler(sampler) -> dict:
  """Median SM MHz and watts, hottest °C; None each without samples."""
  samples = []
  if sampler is not None:
    sampler.terminate()
    for line in sampler.communicate()[0].splitlines():
      try:
        samples.append([float(x) for x in line.split(",")])
      except ValueError:  # "[N/A]" or a line cut by the terminate
        continue
  samples = samples[2:-2] or samples  # the first and last straddle the start and stop
  if not samples:
    return dict(sm_mhz=None, watts=None, max_temp_c=None)
  return dict(sm_mhz=statistics.median(s[0] for s in samples), watts=statistics.median(s[1] for s in samples),
              max_temp_c=max(s[2] for s in samples))


def measure(impl: str, config: benchmark.Config, op: str, seconds: float) -> dict:
  fn, args, flops = step_fn(impl, config, op)
  jax.block_until_ready(fn(*args))
  run_for(fn, args, min(WARMUP_SECONDS, seconds))
  sampler = start_sampler()
  start = time.perf_counter()
  calls = run_for(fn, args, seconds)
  ms = (time.perf_counter() - start) * 1e3 / calls
  row = dict(ms=ms, tflops=flops / ms / 1e9, **stop_sampler(sampler))
  row["tflops_per_ghz"] = row["tflops"] / row["sm_mhz"] * 1e3 if row["sm_mhz"] else None
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impls", nargs="+", default=["jax_flash", "cudnn"], choices=benchmark.IMPLEMENTATIONS)
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--ops", nargs="+", default=["fwd", "step"], choices=["fwd", "step"])
  parser.add_argument("--seq", type=int, default=8192)
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--causal", action="store_true")
  parser.add_argument("--seconds", type=float, default=3.0, help="timed seconds per measurement")
  parser.add_argument("--rounds", type=int, default=2, help="every measurement this many times, in turn")
  parser.add_argument("--out", type=pathlib.Path, help="JSON file to write")
  args = parser.parse_args(argv)
  report = {"gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "seconds": args.seconds,
            "config": dict(seq=args.seq, tokens=args.tokens, heads=args.heads, causal=args.causal), "rows": []}
  print(f"{'op':>4} {'hd':>4} {'impl':<10} {'TFLOPS':>7} {'MHz':>6} {'W':>6} {'TFLOPS/GHz':>10}")
  for round_ in range(args.rounds):
    for op in args.ops:
      for head_dim in args.head_dims:
        config = benchmark.Config(batch=max(args.tokens // args.seq, 1), seq=args.seq, heads=args.heads,
                                  head_dim=head_dim, causal=args.causal)
        for impl in args.impls:
          row = dict(round=round_, op=op, head_dim=head_dim, impl=impl,
                     **measure(impl, config, op, args.seconds))
          report["rows"].append(row)
          per_ghz = "-" if row["tflops_per_ghz"] is None else f"{row['tflops_per_ghz']:.1f}"
          print(f"{op:>4} {head_dim:>4} {impl:<10} {row['tflops']:>7.1f} {row['sm_mhz'] or '-':>6} "
                f"{row['watts'] or '-':>6} {per_ghz:>10}", flush=True)
  if args.out:
    args.out.write_text(json.dumps(report, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
