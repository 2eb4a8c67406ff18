"""Sharded attention on all N >= 2 GPUs of one host against one GPU, in one process.

    python benchmarks/bench_sharded.py --out gpu_out/sharded.json

Three measurements, each against a baseline timed on GPU 0 in the same run:

* ring: ring attention (context parallel, zigzag layout) over all N GPUs on
  one causal sequence of ``--seq`` tokens (batch 1), against the same
  sequence in one ``jax_flash.attention`` call on GPU 0. Strong scaling: the
  work is fixed, so ``scaling_vs_1gpu = t_1gpu / t_Ngpu`` (ideal: N). The
  ring output is also checked against the one-GPU output.
* dp: data parallel, batch ``2 N`` x ``--dp-seq`` sharded over the batch.
* tp: tensor parallel, batch 2 x ``--dp-seq`` with ``--heads * N`` heads
  sharded over the heads.

dp and tp are weak scaling: every GPU holds the baseline's problem (batch 2,
``--heads`` heads, ``--dp-seq``, not causal), so ``scaling_vs_1gpu`` is the
per-GPU throughput ratio ``tflops_N / (N * tflops_1)`` (ideal: 1).

Head dim 128, bfloat16. Rows follow docs/numerics.md and are appended to
``--out``: shapes are the global ones and TFLOPS add up all GPUs. Causal
forward FLOPs are ``2 B H S^2 D``; the backward counts 2.5x the forward and
is timed as (forward + backward) - forward. Ring rows have ``op`` "ring" /
"ring_bwd" (the one-GPU baseline too, with ``variant`` "1gpu"); dp / tp rows
have ``op`` "fwd" / "bwd" and ``variant`` "dp-{N}gpu" / "tp-{N}gpu".
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jax_flash
from jax_flash import _benchmark as benchmark

HEAD_DIM = 128
DP_BATCH_PER_GPU = 2
PARTS = ("ring", "dp", "tp")


def time_ms(fn, args, iters: int, reps: int) -> float:
  """Median milliseconds per call over ``reps`` loops of ``iters`` calls,
  after one call that compiles and warms up."""
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) * 1e3 / iters)
  return statistics.median(samples)


def make_inputs(config: benchmark.Config, sharding):
  """Random (q, k, v, dout) made directly in ``sharding``: a sharded input
  never has to fit on one GPU."""
  return jax.jit(lambda: benchmark.inputs(config), out_shardings=sharding)()


def measure(attend, arrays, config: benchmark.Config, iters: int, reps: int) -> dict:
  """Forward and backward milliseconds and TFLOPS of ``attend(q, k, v)`` on
  ``arrays`` = (q, k, v, dout), wherever they live."""
  q, k, v, dout = arrays

  @jax.jit
  def forward_backward(q, k, v, dout):
    return jax.vjp(attend, q, k, v)[1](dout)

  fwd_ms = time_ms(jax.jit(attend), (q, k, v), iters, reps)
  bwd_ms = max(time_ms(forward_backward, arrays, iters, reps) - fwd_ms, 1e-6)
  flops = config.forward_flops()
  return {"fwd_ms": fwd_ms, "fwd_tflops": flops / fwd_ms / 1e9,
          "bwd_ms": bwd_ms, "bwd_tflops": 2.5 * flops / bwd_ms / 1e9}


def single_gpu_attention(causal: bool):
  return lambda q, k, v: jax_flash.attention(q, k, v, causal=causal, implementation="flash")


def failure(name: str, error: Exception) -> None:
  lines = str(error).splitlines() or [""]
  print(f"{name}: failed: {type(error).__name__}: {lines[0][:160]}", flush=True)


def result_rows(config, result, ceiling, variant: str, ops: dict, num_gpus: int,
                scaling: dict, extra: dict | None = None) -> list:
  """Result rows of one measurement; ``ops`` renames benchmark.rows' "fwd" /
  "bwd", ``scaling`` holds scaling_vs_1gpu per direction."""
  rows = []
  for row in benchmark.rows("jax_flash", config, result, ceiling, variant):
    direction = row["op"]
    ratio = scaling.get(direction)
    rows.append({**row, "op": ops[direction], "num_gpus": num_gpus,
                 "scaling_vs_1gpu": None if ratio is None else round(ratio, 3),
                 "xla_flags": os.environ.get("XLA_FLAGS", ""), **(extra or {})})
  return rows


def report(label: str, result: dict, scaling: dict) -> None:
  ratio = lambda d: "-" if scaling.get(d) is None else f"{scaling[d]:.2f}"
  print(f"{label:<34}" + "".join(
      f"  {d} {result[d + '_ms']:9.2f} ms {result[d + '_tflops']:7.1f} TF x{ratio(d):>5}"
      for d in ("fwd", "bwd")), flush=True)


def ring(args, mesh, ceiling) -> list:
  """Strong scaling of one long causal sequence: the ring over all GPUs
  against one attention call on GPU 0."""
  n = mesh.size
  config = benchmark.Config(1, args.seq, args.heads, HEAD_DIM, causal=True)
  print(f"ring: 1 x {args.seq} tokens, {args.heads} heads, hd{HEAD_DIM}, causal, zigzag over "
        f"{n} GPUs vs GPU 0 (scaling = t_1gpu / t_{n}gpu, ideal {n})", flush=True)
  attend_one = single_gpu_attention(causal=True)
  ops = {"fwd": "ring", "bwd": "ring_bwd"}
  rows, one_gpu, baseline = [], None, None
  try:
    one_gpu = make_inputs(config, SingleDeviceSharding(jax.devices()[0]))
    baseline = measure(attend_one, one_gpu, config, args.iters, args.reps)
    report("1 GPU", baseline, {"fwd": 1.0, "bwd": 1.0})
    rows += result_rows(config, baseline, ceiling, "1gpu", ops, 1, {"fwd": 1.0, "bwd": 1.0})
  except Exception as e:  # the ring still runs; its rows then carry no scaling
    failure("ring baseline (1 GPU)", e)

  ring_sharding = NamedSharding(mesh, P(None, "sp"))
  attend_ring = lambda q, k, v: jax_flash.ring_attention_sharded(
      q, k, v, mesh=mesh, seq_axis="sp", causal=True, layout="zigzag", implementation="flash")
  try:
    if one_gpu is None:  # random data: any order times the same
      sharded = make_inputs(config, ring_sharding)
    else:  # the baseline's sequence in zigzag order, so that the outputs compare
      permute = jax.jit(lambda xs: tuple(jax_flash.to_zigzag(x, n) for x in xs))
      sharded = jax.device_put(permute(one_gpu), ring_sharding)
    result = measure(attend_ring, sharded, config, args.iters, args.reps)
  except Exception as e:
    failure(f"ring ({n} GPUs)", e)
    return rows
  scaling = ({d: baseline[f"{d}_ms"] / result[f"{d}_ms"] for d in ("fwd", "bwd")}
             if baseline else {})
  report(f"ring, {n} GPUs", result, scaling)
  extra = {"layout": "zigzag"}
  if one_gpu is not None:
    try:
      ring_out = jax.device_put(jax.jit(attend_ring)(*sharded[:3]), jax.devices()[0])
      one_out = jax.jit(attend_one)(*one_gpu[:3])
      diff = float(jnp.max(jnp.abs(jax_flash.from_zigzag(ring_out, n).astype(jnp.float32)
                                   - one_out.astype(jnp.float32))))
      extra["max_abs_diff_vs_1gpu"] = diff
      print(f"ring output vs 1 GPU output: max |difference| {diff:.3g}", flush=True)
    except Exception as e:
      failure("ring output check", e)
  return rows + result_rows(config, result, ceiling, f"{n}gpu", ops, n, scaling, extra)


def weak_scaling(args, mesh, ceiling, parts) -> list:
  """Data / tensor parallel jit over all GPUs, each GPU holding the one-GPU
  baseline's problem."""
  n = mesh.size
  base = benchmark.Config(DP_BATCH_PER_GPU, args.dp_seq, args.heads, HEAD_DIM, causal=False)
  print(f"dp / tp: per GPU {base.batch} x {args.dp_seq} tokens, {args.heads} heads, "
        f"hd{HEAD_DIM}, not causal (scaling = per-GPU throughput ratio, ideal 1)", flush=True)
  ops = {"fwd": "fwd", "bwd": "bwd"}
  attend = single_gpu_attention(causal=False)
  rows, baseline = [], None
  try:
    arrays = make_inputs(base, SingleDeviceSharding(jax.devices()[0]))
    baseline = measure(attend, arrays, base, args.dense_iters, args.reps)
    del arrays
    report("1 GPU", baseline, {"fwd": 1.0, "bwd": 1.0})
    rows += result_rows(base, baseline, ceiling, "1gpu", ops, 1, {"fwd": 1.0, "bwd": 1.0})
  except Exception as e:
    failure("dp / tp baseline (1 GPU)", e)
  layouts = {"dp": (benchmark.Config(base.batch * n, args.dp_seq, args.heads, HEAD_DIM, False),
                    P("x")),
             "tp": (benchmark.Config(base.batch, args.dp_seq, args.heads * n, HEAD_DIM, False),
                    P(None, None, "x"))}
  for part in parts:
    config, spec = layouts[part]
    try:
      arrays = make_inputs(config, NamedSharding(mesh, spec))
      result = measure(attend, arrays, config, args.dense_iters, args.reps)
      del arrays
    except Exception as e:
      failure(f"{part} ({n} GPUs)", e)
      continue
    scaling = ({d: result[f"{d}_tflops"] / (n * baseline[f"{d}_tflops"]) for d in ("fwd", "bwd")}
               if baseline else {})
    report(f"{part}, {n} GPUs", result, scaling)
    rows += result_rows(config, result, ceiling, f"{part}-{n}gpu", ops, n, scaling)
  return rows


def save(path: pathlib.Path | None, rows: list) -> None:
  """Appends ``rows`` to the JSON list at ``path``."""
  if path is None or not rows:
    return
  existing = json.loads(path.read_text()) if path.exists() else []
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(existing + rows, indent=1) + "\n")
  print(f"wrote {len(rows)} rows to {path}", flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=131072, help="ring: total sequence length")
  parser.add_argument("--dp-seq", type=int, default=8192, help="dp / tp: sequence length")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
  parser.add_argument("--iters", type=int, default=5, help="ring: calls per timing loop")
  parser.add_argument("--dense-iters", type=int, default=30,
                      help="dp / tp: calls per timing loop (a call takes milliseconds)")
  parser.add_argument("--reps", type=int, default=5, help="timing loops (the median counts)")
  parser.add_argument("--out", type=pathlib.Path, help="JSON file to append rows to")
  parser.add_argument("--overlap", action="store_true",
                      help="add --xla_gpu_enable_latency_hiding_scheduler=true to XLA_FLAGS, "
                           "which lets XLA run the ring's transfers beside the kernels "
                           "(rows record XLA_FLAGS in 'xla_flags')")
  args = parser.parse_args(argv)
  if args.overlap:
    # Read when the GPU client starts, which is after this point.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_gpu_enable_latency_hiding_scheduler=true").strip()

  if jax.default_backend() != "gpu" or jax.device_count() < 2:
    print(f"bench_sharded: needs at least 2 GPUs, found {jax.device_count()} "
          f"{jax.default_backend()} device(s)")
    return 2
  devices = np.array(jax.devices())
  n = len(devices)
  if args.seq % (2 * n):
    parser.error(f"--seq {args.seq} must be a multiple of 2 * {n} (the zigzag chunks)")
  ceiling = benchmark.matmul_ceiling_tflops()
  print(f"{n} x {devices[0].device_kind}, jax {jax.__version__}, bf16 matmul ceiling (GPU 0) "
        f"{ceiling:.0f} TFLOPS", flush=True)
  if "ring" in args.parts:
    save(args.out, ring(args, jax.sharding.Mesh(devices, ("sp",)), ceiling))
  weak = [part for part in args.parts if part != "ring"]
  if weak:
    save(args.out, weak_scaling(args, jax.sharding.Mesh(devices, ("x",)), ceiling, weak))
  return 0


if __name__ == "__main__":
  sys.exit(main())
