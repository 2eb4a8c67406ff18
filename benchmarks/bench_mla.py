"""MLA decoding: jax_flash.mla_decode on bfloat16 and FP8 latent caches
against the XLA composition, in one process on one device.

    python benchmarks/bench_mla.py --out mla.json      # the GPU sweep
    python benchmarks/bench_mla.py --cpu-sizes         # tiny shapes on the CPU

Each shape is a batch of sequences with the same cache length in a shuffled
pool of 64-token pages, ``s_q`` new tokens per sequence (speculative tokens:
causal among themselves), DeepSeek's 576-wide latent rows and 128 query
heads (the compute-bound case) or 16 (one tensor-parallel shard of 128: the
memory-bound case). Implementations of one shape run in turn:

* ``jax_flash``: ``mla_decode`` with ``implementation="flash"`` (a shape
  it cannot serve is reported and skipped): on a Hopper GPU the kernels of
  cuda_src/mla_sm90, for the FP8 cache kernel_fp8.py, its time including the
  queries' quantisation that ``mla_decode`` does before it; the CPU kernel
  with ``--cpu-sizes``, which also runs ``implementation="xla"``. With
  ``--kv-split-sizes``, once per split size (variant ``flash-split2048``;
  ``default``: the default rule, variant ``flash``).
* ``xla`` ``gather``: plain JAX over the gathered pages (the FP8 cache
  dequantised to bfloat16 first): bfloat16 products with float32
  accumulation, a float32 softmax.
* ``xla`` ``contiguous``: the same on latents already contiguous
  ``[batch, seq, 576]`` (bfloat16 rows only): XLA as a model without a paged
  cache runs it.

Rows carry TFLOPS (``Q K^T`` over 576 columns plus ``P V`` over 512, per
visible key), GB/s (the cache bytes read once: 1152 per token in bfloat16,
644 in FP8), and their fractions of a matrix-product ceiling (bfloat16, or
FP8 for FP8 rows) and of a copy ceiling (read + write of a large array),
measured in the same run.
"""

import argparse
import datetime
import functools
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _benchmark as benchmark, _mla as mla, _mla_fp8 as mla_fp8

SCALE = 192 ** -0.5
PAGE, LATENT, WIDTH = mla_fp8.PAGE_SIZE, mla_fp8.LATENT_DIM, mla_fp8.HEAD_DIM
KV_DTYPES = ("bfloat16", "float8_e4m3fn")
IMPLS = ("jax_flash", "xla")
BYTES_PER_TOKEN = {"bfloat16": 2 * WIDTH,
                   "float8_e4m3fn": LATENT + 4 + 2 * mla_fp8.ROPE_DIM}  # 1152 and 644
GPU_SIZES = dict(batches=(128, 32), seqs=(4096, 8192, 16384, 32768), s_qs=(1, 2),
                 heads=(128, 16), kv_dtypes=KV_DTYPES, impls=IMPLS, kv_split_sizes=(None,))
CPU_SIZES = dict(batches=(2,), seqs=(256, 1024), s_qs=(1, 2), heads=(16,), kv_dtypes=KV_DTYPES,
                 impls=IMPLS, kv_split_sizes=(None,))
# The XLA composition holds the gathered cache and the float32 logits beside
# the pool: shapes past this many cached tokens skip it.
MAX_XLA_TOKENS = 1 << 22


def inputs(batch, seq, s_q, heads, kv_dtype, seed=0):
  """(q, cache, page_table, cache_lengths) for ``batch`` sequences of
  ``seq`` cached tokens in a shuffled page pool."""
  pages = batch * -(-seq // PAGE)
  keys = jax.random.split(jax.random.key(seed), 2)
  rows = jax.random.normal(keys[0], (pages, PAGE, WIDTH), jnp.bfloat16)
  cache = mla.MlaFp8Cache(*mla_fp8.quantize_latent(rows)) if kv_dtype != "bfloat16" else rows
  table = np.random.default_rng(seed).permutation(pages).astype(np.int32).reshape(batch, -1)
  q = jax.random.normal(keys[1], (batch, s_q, heads, WIDTH), jnp.bfloat16)
  return q, cache, jnp.asarray(table), jnp.full((batch,), seq, jnp.int32)


def gathered_rows(cache, table):
  """The sequences' rows ``[batch, seq, 576]`` in bfloat16 (FP8 dequantised)."""
  batch = table.shape[0]
  if isinstance(cache, mla.MlaFp8Cache):
    latent = cache.latent[table].astype(jnp.bfloat16) * cache.scales[table][..., None].astype(
        jnp.bfloat16)
    rows = jnp.concatenate([latent, cache.rope[table]], axis=-1)
  else:
    rows = cache[table]
  return rows.reshape(batch, -1, WIDTH)


def xla_attention(q, rows, lengths, widen=False):
  """Plain JAX MLA over contiguous rows: what a model without jax_flash runs.
  ``widen``: the operands in float32 (XLA:CPU has no bfloat16 product with a
  float32 result)."""
  s_q, seq = q.shape[1], rows.shape[1]
  out_dtype = q.dtype
  if widen:
    q, rows = q.astype(jnp.float32), rows.astype(jnp.float32)
  logits = jnp.einsum("bthd,bsd->bhts", q, rows, preferred_element_type=jnp.float32) * SCALE
  position = lengths[:, None] - s_q + jnp.arange(s_q)[None]  # [batch, s_q]
  visible = jnp.arange(seq)[None, None] <= position[..., None]
  p = jax.nn.softmax(jnp.where(visible[:, None], logits, -jnp.inf), axis=-1)
  out = jnp.einsum("bhts,bsd->bthd", p.astype(q.dtype), rows[..., :LATENT],
                   preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def implementations(kv_dtype, cpu, kv_split_sizes):
  """(impl, variant, fn(q, cache or rows, table, lengths), takes contiguous rows, kv_split_size)"""
  xla = functools.partial(xla_attention, widen=cpu)
  plans = [("jax_flash", variant + (f"-split{size}" if size else ""),
            functools.partial(jax_flash.mla_decode, scale=SCALE, implementation=variant,
                              kv_split_size=size), False, size)
           for variant in (("flash", "xla") if cpu else ("flash",)) for size in kv_split_sizes]
  plans.append(("xla", "gather", lambda q, c, t, n: xla(q, gathered_rows(c, t), n), False, None))
  if kv_dtype == "bfloat16":
    plans.append(("xla", "contiguous", lambda q, rows, t, n: xla(q, rows, n), True, None))
  return plans


def flops(batch, seq, s_q, heads):
  """Q K^T and P V multiply-adds over the keys each query row sees."""
  visible = sum(seq - s_q + 1 + t for t in range(s_q))
  return 2.0 * batch * heads * visible * (WIDTH + LATENT)


def ceilings(cpu: bool) -> dict:
  """Matrix-product TFLOPS (bfloat16; FP8 where this device runs an FP8
  product) and copy GB/s (read + write of a large array), measured here."""
  n, copy_bytes = (1024, 1 << 26) if cpu else (8192, 1 << 32)
  result = {"bfloat16": benchmark.matmul_ceiling_tflops(n=n)}
  try:
    a = jax.random.normal(jax.random.key(2), (n, n)).astype(jnp.float8_e4m3fn)
    fp8 = jax.jit(lambda a, b: jax.lax.dot(a, b.T, preferred_element_type=jnp.bfloat16))
    result["float8_e4m3fn"] = 2.0 * n ** 3 / benchmark._time(fp8, (a, a)) / 1e9
  except Exception as e:  # no FP8 product on this device: no FP8 fraction
    print(f"FP8 matmul ceiling: {benchmark.error_summary(e)}", flush=True)
    result["float8_e4m3fn"] = None
  x = jnp.ones((copy_bytes // 2,), jnp.bfloat16)
  result["copy_gbps"] = 2 * x.nbytes / benchmark._time(jax.jit(lambda x: x + 1), (x,)) / 1e6
  return result


def run(sizes, cpu, ceiling):
  rows = []
  print(f"{'kv':>5} {'B':>4} {'S':>6} {'s_q':>3} {'H':>4}  {'impl':<20}{'ms':>9}{'TFLOPS':>8}"
        f"{'GB/s':>8}{'mm':>6}{'copy':>6}", flush=True)
  for kv_dtype in sizes["kv_dtypes"]:
    for heads in sizes["heads"]:
      for batch in sizes["batches"]:
        for seq in sizes["seqs"]:
          for s_q in sizes["s_qs"]:
            args = inputs(batch, seq, s_q, heads, kv_dtype)
            contiguous = None
            for impl, variant, fn, wants_rows, split in implementations(
                kv_dtype, cpu, sizes["kv_split_sizes"]):
              label = f"{impl}:{variant}"
              if impl not in sizes["impls"]:
                continue
              if impl == "xla" and batch * seq > MAX_XLA_TOKENS:
                continue
              if wants_rows and contiguous is None:
                contiguous = jax.block_until_ready(gathered_rows(args[1], args[2]))
              try:
                ms = benchmark._time(jax.jit(fn), (args[0], contiguous, *args[2:]) if wants_rows
                                     else args)
              except Exception as e:  # an implementation that rejects the shape is reported
                print(f"{kv_dtype[:5]:>5} {batch:>4} {seq:>6} {s_q:>3} {heads:>4}  {label:<20}"
                      f"failed: {benchmark.error_summary(e)}", flush=True)
                continue
              tflops = flops(batch, seq, s_q, heads) / ms / 1e9
              gbps = batch * seq * BYTES_PER_TOKEN[kv_dtype] / ms / 1e6
              matmul = ceiling[kv_dtype] and tflops / ceiling[kv_dtype]
              copy = gbps / ceiling["copy_gbps"]
              print(f"{kv_dtype[:5]:>5} {batch:>4} {seq:>6} {s_q:>3} {heads:>4}  {label:<20}"
                    f"{ms:9.4f}{tflops:8.3g}{gbps:8.4g}{matmul or 0:6.2f}{copy:6.2f}", flush=True)
              rows.append({
                  "impl": impl, "op": "mla_decode", "dtype": "bfloat16", "kv_dtype": kv_dtype,
                  "batch": batch, "seq_q": s_q, "seq_k": seq, "heads_q": heads, "heads_kv": 1,
                  "head_dim": WIDTH, "head_dim_v": LATENT, "causal": True, "window": None,
                  "variant": variant, "tflops": float(f"{tflops:.4g}"), "ms": round(ms, 4),
                  "gbps": float(f"{gbps:.4g}"), "page_size": PAGE, "kv_split_size": split,
                  "matmul_fraction": None if matmul is None else round(matmul, 3),
                  "copy_fraction": round(copy, 3)})
            del args, contiguous
  print_fp8_speedups(rows)
  return rows


def print_fp8_speedups(rows):
  """jax_flash's FP8 cache against its bfloat16 cache, shape by shape."""
  times = {(r["kv_dtype"], r["variant"], r["batch"], r["seq_k"], r["seq_q"], r["heads_q"]):
           r["ms"] for r in rows if r["impl"] == "jax_flash"}
  for (kv_dtype, variant, *shape), ms in times.items():
    bf16 = times.get(("bfloat16", variant, *shape))
    if kv_dtype != "bfloat16" and bf16:
      batch, seq, s_q, heads = shape
      print(f"FP8 / bfloat16 throughput, {variant}, B {batch} S {seq} s_q {s_q} H {heads}: "
            f"{bf16 / ms:.2f}x", flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cpu-sizes", action="store_true",
                      help="tiny shapes on the CPU: jax_flash's CPU kernel and its XLA composition")
  parser.add_argument("--batches", type=int, nargs="+")
  parser.add_argument("--seqs", type=int, nargs="+")
  parser.add_argument("--s-qs", type=int, nargs="+")
  parser.add_argument("--heads", type=int, nargs="+")
  parser.add_argument("--kv-dtypes", nargs="+", choices=KV_DTYPES)
  parser.add_argument("--impls", nargs="+", choices=IMPLS)
  parser.add_argument("--kv-split-sizes", nargs="+",
                      type=lambda v: None if v == "default" else int(v),
                      help="mla_decode's kv_split_size values to run jax_flash with ('default': "
                           "its default rule)")
  parser.add_argument("--out", type=pathlib.Path, help="results file to write (one run)")
  args = parser.parse_args(argv)
  if not args.cpu_sizes and jax.default_backend() != "gpu":
    print("bench_mla: needs a GPU (or --cpu-sizes)")
    return 2
  sizes = {**(CPU_SIZES if args.cpu_sizes else GPU_SIZES),
           **{k: tuple(v) for k in ("batches", "seqs", "s_qs", "heads", "kv_dtypes", "impls",
                                    "kv_split_sizes")
              if (v := getattr(args, k)) is not None}}
  device = jax.devices("cpu" if args.cpu_sizes else "gpu")[0]
  with jax.default_device(device):
    ceiling = ceilings(args.cpu_sizes)
    summary = (f"matmul ceiling {ceiling['bfloat16']:.1f} TFLOPS bfloat16, "
               + (f"{ceiling['float8_e4m3fn']:.1f} FP8" if ceiling["float8_e4m3fn"] else "no FP8")
               + f"; copy ceiling {ceiling['copy_gbps']:.0f} GB/s")
    print(f"{device.device_kind}, jax {jax.__version__}; {summary}", flush=True)
    rows = run(sizes, args.cpu_sizes, ceiling)
  if args.out:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    header = {"gpu": "cpu" if args.cpu_sizes else device.device_kind, "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "commit": commit,
              "command": "python benchmarks/bench_mla.py " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "note": summary, "matmul_ceiling_tflops": round(ceiling["bfloat16"], 1)}
    args.out.write_text(json.dumps({"run": header, "rows": rows}, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
