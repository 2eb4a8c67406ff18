"""jax_flash against cuDNN and XLA, in one process on one GPU.

    python benchmarks/bench_attention.py --head-dims 64 128 256 --seqs 2048 8192 \
        --out benchmarks/results/h100-2026-11-21.json

Every configuration keeps ``--tokens`` tokens per batch (batch = tokens / seq)
and ``--heads`` heads. Prints TFLOPS, the ratio to cuDNN and the fraction of a
bf16 matmul ceiling measured in the same run; appends DESIGN.md §8 rows to
``--out``.
"""

import argparse
import itertools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash import benchmark

# XLA materialises the [B, N, S, S] scores; past this length it runs out of memory.
XLA_MAX_SEQ = 8192


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
  parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
  parser.add_argument("--impls", nargs="+", default=list(benchmark.IMPLEMENTATIONS))
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--out", type=pathlib.Path, help="JSON file to append rows to")
  parser.add_argument("--packed-docs", type=int, default=0,
                      help="instead: one --tokens row of this many packed documents, causal, "
                           "first --head-dims entry; segment ids vs the dense causal row")
  args = parser.parse_args(argv)

  if jax.default_backend() != "gpu":
    print("bench_attention: needs a GPU (jax.default_backend() is "
          f"{jax.default_backend()!r}); `python -m jax_flash` benchmarks the CPU kernels")
    return 2
  causal_values = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
  ceiling = benchmark.matmul_ceiling_tflops()
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, bf16 matmul ceiling "
        f"{ceiling:.0f} TFLOPS")
  if args.packed_docs:
    return packed(args, ceiling)
  header = (f"{'hd':>4}{'seq':>7}{'causal':>7}{'impl':>11}{'fwd TF':>9}{'bwd TF':>9}"
            f"{'fwd/cudnn':>11}{'bwd/cudnn':>11}{'fwd/ceil':>10}")
  print(header)
  rows = []
  for head_dim, seq, causal in itertools.product(args.head_dims, args.seqs, causal_values):
    config = benchmark.Config(max(args.tokens // seq, 1), seq, args.heads, head_dim, causal,
                              args.dtype)
    results = {}
    for impl in args.impls:
      if impl == "xla" and seq > XLA_MAX_SEQ:
        continue
      try:
        results[impl] = benchmark.measure(impl, config, iters=args.iters)
      except Exception as e:  # an anchor that rejects a configuration is reported, not fatal
        print(f"{head_dim:>4}{seq:>7}{str(causal):>7}{impl:>11}  failed: {type(e).__name__}: "
              f"{str(e).splitlines()[0][:80]}")
        continue
      rows += benchmark.rows(impl, config, results[impl], ceiling)
    anchor = results.get("cudnn")
    for impl, r in results.items():
      ratio = lambda op: (f"{r[op + '_tflops'] / anchor[op + '_tflops']:>11.2f}" if anchor
                          else f"{'-':>11}")
      print(f"{head_dim:>4}{seq:>7}{str(causal):>7}{impl:>11}{r['fwd_tflops']:>9.1f}"
            f"{r['bwd_tflops']:>9.1f}{ratio('fwd')}{ratio('bwd')}{r['fwd_tflops'] / ceiling:>10.2f}",
            flush=True)
  if args.out:
    existing = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(existing + rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
  return 0


def packed(args, ceiling: float) -> int:
  """Issue 5's packed-row benchmark: milliseconds of jax_flash with segment
  ids, of the same kernel on the dense causal row, and of cuDNN with JAX's
  segment offsets, plus cuDNN's largest difference from jax_flash."""
  config = benchmark.Config(1, args.tokens, args.heads, args.head_dims[0], True, args.dtype)
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
