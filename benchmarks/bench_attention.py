"""jax_flash against cuDNN, JAX's Pallas Mosaic GPU attention and XLA, in one process on one GPU.

    python benchmarks/bench_attention.py --out gpu_out/bench.json --plot sweep_bf16.png
    python benchmarks/bench_attention.py --dtype float16 --head-dims 128   # with Pallas
    python benchmarks/bench_attention.py --impls jax_flash --sinks --head-dims 64 128 --seqs 8192

The default sweep is issue 3's grid: head dims 64, 128, 256 x sequence lengths
1k to 32k x causal and not. Every configuration keeps ``--tokens`` tokens per
batch (batch = tokens / seq) and ``--heads`` heads, and every implementation
gets the same inputs. Prints TFLOPS, the ratio to cuDNN and the fraction of a
matmul ceiling (in ``--dtype``) measured in the same run; appends result rows
(docs/numerics.md) to ``--out``, which ``benchmarks/add_run.py`` files as a run
in benchmarks/results/; ``--plot`` draws them (``benchmarks/plot_results.py``).
Pallas Mosaic GPU (``pallas_mgpu``) runs in float16 on Hopper only. Unless
``--iters`` is given, the forward and the forward + backward timings each last
about a quarter second, so a measurement takes about a second with compiling.
"""

import argparse
import inspect
import itertools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import jax_flash
import plot_results
from jax_flash import _benchmark as benchmark

# XLA materialises the [B, N, S, S] scores; past this length it runs out of memory.
XLA_MAX_SEQ = 8192
DETERMINISTIC = "deterministic"
SINKS = "sinks"
HEADER = (f"{'hd':>7}{'seq':>7}{'causal':>7}  {'impl':<24}{'fwd TF':>8}{'bwd TF':>8}"
          f"{'fwd/cuDNN':>10}{'bwd/cuDNN':>10}{'fwd/ceil':>9}{'bwd/ceil':>9}{'elapsed':>9}")


def head_dims_arg(text: str):
  """``128`` -> 128; ``192/128`` -> (192, 128): head dim and V head dim."""
  dims = tuple(int(part) for part in text.split("/"))
  if len(dims) > 2:
    raise argparse.ArgumentTypeError(f"expected HEAD_DIM or HEAD_DIM/HEAD_DIM_V, got {text!r}")
  return dims[0] if len(dims) == 1 else dims


def _dims(entry) -> tuple:
  return (entry, None) if isinstance(entry, int) else entry


def sweep_configs(head_dims, seqs, causal_values, tokens: int, heads: int, dtype: str) -> list:
  """One Config per (head dim, seq, causal), ``tokens`` tokens per batch; a
  head dims entry is an int or a (head_dim, head_dim_v) pair."""
  return [benchmark.Config(max(tokens // seq, 1), seq, heads, _dims(entry)[0], causal, dtype,
                           head_dim_v=_dims(entry)[1])
          for entry, seq, causal in itertools.product(head_dims, seqs, causal_values)]


def measured_line(config, name: str, result: dict, anchor: dict | None, ceiling: float,
                  elapsed_s: float) -> str:
  """One table line: TFLOPS, ratios to cuDNN (``anchor``) and to the matmul
  ceiling; a dash where a number is missing."""
  def number(value, width, digits):
    return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

  def ratio(op, reference):
    value = result.get(f"{op}_tflops")
    return None if value is None or not reference else value / reference

  cells = [number(result.get("fwd_tflops"), 8, 1), number(result.get("bwd_tflops"), 8, 1)]
  anchor = anchor or {}
  cells += [number(ratio(op, anchor.get(f"{op}_tflops")), 10, 2) for op in ("fwd", "bwd")]
  cells += [number(ratio(op, ceiling), 9, 2) for op in ("fwd", "bwd")]
  return (f"{config.dims_label:>7}{config.seq:>7}{str(config.causal):>7}  {name:<24}"
          + "".join(cells) + f"{elapsed_s:>8.0f}s")


def median_results(rounds: list) -> dict:
  """Per implementation, the median TFLOPS of each op over the rounds that
  measured it (``rounds``: one {name: result} dict per round)."""
  medians = {}
  for name in dict.fromkeys(name for results in rounds for name in results):
    medians[name] = {}
    for key in ("fwd_tflops", "bwd_tflops"):
      values = [results[name][key] for results in rounds if key in results.get(name, {})]
      if values:
        medians[name][key] = statistics.median(values)
  return medians


def measurements(impls, deterministic: bool, label: str = "", softcap: float | None = None,
                 sinks: bool = False) -> list:
  """(impl, variant, jax_flash options) to time per configuration, cuDNN first
  so that every line can print its ratio to it. ``label`` names the variant
  of jax_flash's rows (a kernel alternative); ``softcap`` adds jax_flash
  with that cap (cuDNN's JAX API has none: its ratio is to uncapped cuDNN);
  ``sinks`` adds jax_flash with attention sinks (``measure_with_sinks``)."""
  plan = [(impl, label if impl == "jax_flash" else "", {})
          for impl in sorted(impls, key=lambda impl: impl != "cudnn")]
  if deterministic:
    plan.append(("jax_flash", "-".join(filter(None, (label, DETERMINISTIC))),
                 {"deterministic": True}))
  if softcap is not None:
    plan.append(("jax_flash", "-".join(filter(None, (label, f"softcap-{softcap:g}"))),
                 {"softcap": softcap}))
  if sinks:
    plan.append(("jax_flash", "-".join(filter(None, (label, SINKS))), {SINKS: True}))
  return plan


def measure_with_sinks(impl: str, config, iters=None, backward: bool = True, sinks: bool = True):
  """``benchmark.measure`` of jax_flash with random attention sinks, which
  the backward differentiates too, as training a learnable sink does."""
  del impl, sinks  # the signature of benchmark.measure, called for jax_flash's sinks entry
  q, k, v, dout = benchmark.inputs(config)
  sink_values = jax.random.normal(jax.random.key(1), (config.heads,), jnp.float32)
  attend = lambda q, k, v, sinks: jax_flash.attention(q, k, v, causal=config.causal, sinks=sinks,
                                                      implementation="flash")

  @jax.jit
  def forward_backward(q, k, v, sinks, dout):
    return jax.vjp(attend, q, k, v, sinks)[1](dout)

  result = {"fwd_ms": benchmark._time(jax.jit(attend), (q, k, v, sink_values), iters)}
  result["fwd_tflops"] = config.forward_flops() / result["fwd_ms"] / 1e9
  if backward:
    try:
      total = benchmark._time(forward_backward, (q, k, v, sink_values, dout), iters)
    except Exception as e:  # reported beside the forward numbers, as benchmark.measure does
      result["bwd_error"] = benchmark.error_summary(e)
      return result
    result["bwd_ms"] = max(total - result["fwd_ms"], 1e-6)
    result["bwd_tflops"] = config.backward_flops() / result["bwd_ms"] / 1e9
  return result


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", type=head_dims_arg, nargs="+", default=[64, 128, 256],
                      help="head dims; HEAD_DIM/HEAD_DIM_V for a narrower V, e.g. 192/128 "
                           "(cuDNN and Pallas take V padded, as their JAX APIs require)")
  parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
  parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
  parser.add_argument("--impls", nargs="+", default=list(benchmark.IMPLEMENTATIONS),
                      choices=benchmark.IMPLEMENTATIONS)
  parser.add_argument("--rounds", type=int, default=1,
                      help="time every implementation this many times per configuration, in "
                           "turn, and print the medians and their ratios to cuDNN's: a single "
                           "timing moves by 2-3%% from run to run")
  parser.add_argument("--iters", type=int,
                      help="calls per timing loop (default: as many as last about 0.05 s; 5 loops)")
  parser.add_argument("--forward-only", action="store_true",
                      help="time the forward alone (forward kernel alternatives): half the "
                           "time of a sweep")
  parser.add_argument("--deterministic", action="store_true",
                      help=f"also time jax_flash with deterministic=True (rows with variant "
                           f"{DETERMINISTIC!r})")
  parser.add_argument("--softcap", type=float,
                      help="also time jax_flash with this logit softcap (rows with variant "
                           "'softcap-C')")
  parser.add_argument("--sinks", action="store_true",
                      help=f"also time jax_flash with random attention sinks, differentiated "
                           f"like q, k and v (rows with variant {SINKS!r})")
  parser.add_argument("--variant", default="",
                      help="variant of the jax_flash rows, e.g. the name of a kernel alternative "
                           "loaded with JAX_FLASH_CUDA_LIBRARY (scripts/build_alternative.sh)")
  parser.add_argument("--out", type=pathlib.Path, help="JSON file to append rows to")
  parser.add_argument("--plot", type=pathlib.Path,
                      help="PNG of this run's TFLOPS against sequence length (needs matplotlib)")
  parser.add_argument("--packed-docs", type=int, default=0,
                      help="instead: one --tokens row of this many packed documents, causal, "
                           "first --head-dims entry; segment ids vs the dense causal row")
  return parser


def main(argv=None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.rounds < 1:
    parser.error(f"--rounds must be >= 1, got {args.rounds}")

  if jax.default_backend() != "gpu":
    print("bench_attention: needs a GPU (jax.default_backend() is "
          f"{jax.default_backend()!r}); `python -m jax_flash` benchmarks the CPU kernels")
    return 2
  causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  ceiling = benchmark.matmul_ceiling_tflops(dtype=args.dtype)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.dtype} matmul ceiling "
        f"{ceiling:.0f} TFLOPS", flush=True)
  if args.packed_docs:
    return packed(args, ceiling)

  impls = []
  for impl in args.impls:
    reason = benchmark.skip_reason(impl, args.dtype)
    if reason:
      print(f"{impl}: {reason}, skipped")
    else:
      impls.append(impl)
  deterministic = args.deterministic
  if deterministic and DETERMINISTIC not in inspect.signature(jax_flash.attention).parameters:
    print("--deterministic: jax_flash.attention has no `deterministic` keyword in this build; "
          "skipped")
    deterministic = False
  plan = measurements(impls, deterministic, args.variant, args.softcap, args.sinks)
  configs = sweep_configs(args.head_dims, args.seqs, causal_values, args.tokens, args.heads,
                          args.dtype)
  print(f"{len(configs)} configurations x {len(plan)} implementations", flush=True)
  print(HEADER, flush=True)
  start = time.perf_counter()
  rows, reported_errors = [], set()
  for config in configs:
    rounds = []
    for round_ in range(args.rounds):
      results = {}
      for impl, variant, options in plan:
        if impl == "xla" and config.seq > XLA_MAX_SEQ:
          continue
        name = f"{impl}:{variant}" if variant else impl
        try:
          measure = measure_with_sinks if options.get(SINKS) else benchmark.measure
          result = measure(impl, config, iters=args.iters, backward=not args.forward_only,
                           **options)
        except Exception as e:  # a configuration an implementation rejects is reported, not fatal
          print(f"{config.dims_label:>7}{config.seq:>7}{str(config.causal):>7}  {name:<24}failed: "
                f"{benchmark.error_summary(e)}", flush=True)
          continue
        results[name] = result
        rows += [dict(row, round=round_) if args.rounds > 1 else row
                 for row in benchmark.rows(impl, config, result, ceiling, variant)]
        print(measured_line(config, name, result, results.get("cudnn"), ceiling,
                            time.perf_counter() - start), flush=True)
        if "bwd_error" in result and (name, result["bwd_error"]) not in reported_errors:
          reported_errors.add((name, result["bwd_error"]))
          print(f"      {name} has no backward here: {result['bwd_error']}", flush=True)
      rounds.append(results)
    if args.rounds > 1:
      medians = median_results(rounds)
      for name, result in medians.items():
        print(measured_line(config, f"{name} (median)", result, medians.get("cudnn"), ceiling,
                            time.perf_counter() - start), flush=True)

  if args.out:
    existing = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(existing + rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
  if args.plot:
    try:
      plot_results.plot(rows, args.plot)
      print(f"wrote {args.plot}")
    except ImportError:
      print(f"--plot: matplotlib is not installed here; draw the rows elsewhere with "
            f"`python benchmarks/plot_results.py {args.out or 'RESULTS.json'} --out {args.plot}`")
    except ValueError as e:
      print(f"--plot: {e}")
  return 0


def packed(args, ceiling: float) -> int:
  """Issue 5's packed-row benchmark: milliseconds of jax_flash with segment
  ids, of the same kernel on the dense causal row, and of cuDNN with JAX's
  segment offsets, plus cuDNN's largest difference from jax_flash."""
  head_dim, head_dim_v = _dims(args.head_dims[0])
  config = benchmark.Config(1, args.tokens, args.heads, head_dim, True, args.dtype,
                            head_dim_v=head_dim_v)
  ids, lengths = benchmark.packed_document_ids(args.tokens, args.packed_docs)
  variant = f"packed-{args.packed_docs}-docs"
  results = {("jax_flash", variant): benchmark.measure_packed(config, ids, iters=args.iters),
             ("jax_flash", variant + "-dense"): benchmark.measure_packed(config, None,
                                                                         iters=args.iters)}
  print(f"document lengths {lengths.tolist()}")
  try:
    results["cudnn", variant], cudnn_out = benchmark.measure_cudnn_packed(config, lengths,
                                                                          iters=args.iters)
    q, k, v, _ = benchmark.inputs(config)
    ours = jax.jit(lambda q, k, v: jax_flash.attention(q, k, v, causal=True, segment_ids=ids))(
        q, k, v)
    diff = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - cudnn_out.astype(jnp.float32))))
    print(f"cuDNN vs jax_flash on the packed row: max |difference| {diff:.3g}")
  except Exception as e:  # the private API moves between JAX versions
    print(f"cuDNN packed: failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
  rows = []
  for (impl, name), r in results.items():
    for op in ("fwd", "bwd"):
      row = benchmark.rows(impl, config, {f"{op}_ms": r[f"{op}_ms"], f"{op}_tflops": 0.0},
                           ceiling, name)[0]
      rows.append({**row, "tflops": None})
  base = results["jax_flash", variant]
  for (impl, name), r in results.items():
    print(f"{impl:>10} {name:<22}" + "".join(
        f"  {op} {r[op + '_ms']:.3f} ms ({r[op + '_ms'] / base[op + '_ms']:.2f}x segments)"
        for op in ("fwd", "bwd")))
  if args.out:
    existing = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps(existing + rows, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
