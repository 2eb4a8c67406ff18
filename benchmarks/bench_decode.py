"""One decoding step with GQA: jax_flash as it runs by default (query heads
packed into one tile, keys split into chunks: head_packing.py, kv_split.py),
the same kernels with neither, cuDNN and XLA, in one process on one GPU.

    python benchmarks/bench_decode.py --out gpu_out/bench.json

Each configuration is ``--batch`` sequences of one new query against
``seq_k`` keys (causal: the query sees them all, so the anchors run
unmasked), ``--heads`` query heads sharing ``--heads-kv`` kv heads. A
decoding step reads K and V once,
so rows carry ``gbps``: K/V bytes over the forward time (the bandwidth the
memory-bound kernel reaches). Each implementation is timed twice: one step
per jitted call (``ms``: the host's per-call work shows when a step is
short) and ``--chain`` dependent steps in one call (``ms_chained``, per
step: the GPU's time, which is what a step costs inside a model whose other
layers hide the host's work). Rows: impl "jax_flash" with variant
"gqa-packed-split" (the default) / "gqa-plain", "cudnn" and "xla" with
variant "gqa".
"""

import argparse
import contextlib
import dataclasses
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

import jax_flash
from jax_flash import _benchmark as benchmark, _configs as configs


@contextlib.contextmanager
def plain_kernel_calls():
  """The GPU backend with query-head packing and split-KV turned off (for
  comparison): no query count is below one row, no grid is too small.

  The routing tables are read while tracing, so JAX's caches are cleared on
  the way in and out: a trace cached under one table would serve the other
  (on an H100 with JAX 0.11.2 the default path ran the plain kernel call in
  every run from 22 to 82)."""
  original = configs.BACKENDS["gpu"]
  jax.clear_caches()
  configs.BACKENDS["gpu"] = dataclasses.replace(original, query_tile_rows=1, kv_split_ctas=0)
  try:
    yield
  finally:
    configs.BACKENDS["gpu"] = original
    jax.clear_caches()


def kernel_output_shapes(compiled_hlo: str) -> list[str]:
  """The output shapes of the jax_flash kernel calls in compiled HLO text:
  what a decoding step really ran (packed heads and key chunks show there)."""
  return re.findall(r"= \((\w+\[[\d,]*\])[^\n]*custom_call_target=\"jax_flash_", compiled_hlo)


def make_inputs(batch, queries, seq_k, heads, heads_kv, head_dim, dtype):
  keys = jax.random.split(jax.random.key(0), 3)
  make = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return (make(keys[0], (batch, queries, heads, head_dim)),
          make(keys[1], (batch, seq_k, heads_kv, head_dim)),
          make(keys[2], (batch, seq_k, heads_kv, head_dim)))


def chained(step, steps: int):
  """``steps`` decoding steps in one function, each step's output the next
  step's query (so none can be skipped or merged)."""
  def run(q, k, v):
    for _ in range(steps):
      q = step(q, k, v)
    return q
  return run


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--heads-kv", type=int, default=4)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
  parser.add_argument("--chain", type=int, default=16, help="steps per call for ms_chained")
  parser.add_argument("--out", type=pathlib.Path, help="JSON file to append rows to")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    print("bench_decode: needs a GPU")
    return 2
  device = jax.devices()[0]
  print(f"{device.device_kind}, jax {jax.__version__}, {args.dtype}, batch {args.batch}, "
        f"heads {args.heads}/{args.heads_kv}, hd{args.head_dim}", flush=True)
  print(f"{'seq_k':>7}  {'impl':<24}{'ms':>9}{'GB/s':>8}{'x plain':>9}"
        f"{'chained':>9}{'GB/s':>8}  kernel outputs", flush=True)
  rows = []
  for seq_k in args.seqs:
    q, k, v = make_inputs(args.batch, 1, seq_k, args.heads, args.heads_kv, args.head_dim,
                          args.dtype)
    kv_bytes = 2 * k.size * k.dtype.itemsize
    plan = [
        ("jax_flash", "gqa-plain", plain_kernel_calls),
        ("jax_flash", "gqa-packed-split", contextlib.nullcontext),
        ("cudnn", "gqa", contextlib.nullcontext),
        ("xla", "gqa", contextlib.nullcontext),
    ]
    plain_ms = None
    for impl, variant, context in plan:
      if impl == "jax_flash":
        attend = lambda q, k, v: jax_flash.attention(q, k, v, causal=True,
                                                     implementation="flash")
      else:
        attend = anchor_fn(impl)
      try:
        with context():
          timed = jax.jit(attend)
          ms = benchmark._time(timed, (q, k, v))
          kernels = kernel_output_shapes(timed.lower(q, k, v).compile().as_text())
          chained_ms = benchmark._time(jax.jit(chained(attend, args.chain)), (q, k, v))
          chained_ms /= args.chain
      except Exception as e:  # an implementation that rejects the shape is reported
        print(f"{seq_k:>7}  {impl + ':' + variant:<24}failed: "
              f"{benchmark.error_summary(e)}", flush=True)
        continue
      if variant == "gqa-plain":
        plain_ms = ms
      gbps = kv_bytes / ms / 1e6
      ratio = f"{plain_ms / ms:.2f}" if plain_ms else "-"
      print(f"{seq_k:>7}  {impl + ':' + variant:<24}{ms:9.4f}{gbps:8.0f}{ratio:>9}"
            f"{chained_ms:9.4f}{kv_bytes / chained_ms / 1e6:8.0f}  {' '.join(kernels)}",
            flush=True)
      rows.append({
          "impl": impl, "dtype": args.dtype, "batch": args.batch, "seq_q": 1,
          "seq_k": seq_k, "heads_q": args.heads, "heads_kv": args.heads_kv,
          "head_dim": args.head_dim, "head_dim_v": args.head_dim, "causal": True,
          "window": None, "variant": variant, "op": "fwd", "tflops": None,
          "ms": round(ms, 4), "gbps": round(gbps, 1),
          "ms_chained": round(chained_ms, 4), "chained_steps": args.chain, "gpu": device.device_kind,
          "jax": jax.__version__, "date": benchmark.datetime.date.today().isoformat(),
          "matmul_ceiling_tflops": None, "kernel_outputs": kernels})
  if args.out:
    existing = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(existing + rows, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
  return 0


def anchor_fn(impl: str):
  # jax.nn aligns a causal mask top-left; the one query of a decoding step
  # sees every key, which unmasked attention computes.
  return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl)


if __name__ == "__main__":
  sys.exit(main())
