"""Paged KV-cache attention: jax_flash.paged_attention against cuDNN's paged
attention (JAX-private), cuDNN on a contiguous cache, JAX's Pallas paged
kernel and XLA over gathered pages, in one process on one GPU.

    python benchmarks/bench_paged.py --out paged.json

Decode rows (one new token per sequence, 32 query / 8 kv heads, hd128) read
every cached K / V byte once: ``gbps`` is those bytes over the time, beside
a copy ceiling (read + write of a large array) measured in the same run.
``--kv-dtypes float8_e4m3fn`` adds jax_flash on an FP8 cache of the same
values (``Fp8Pages``: codes and a scale per token and kv head); each decode
row gives ``tokens_per_s``, cached tokens read per second, to compare the
two caches by.
Chunked-prefill rows put 2048 new tokens against a longer cache, causal from
the bottom right, in TFLOPS beside jax_flash.attention on the same keys held
contiguously. Each row names its page size; the implementations of one
shape run in turn, and each timing is the median of a few.
"""

import argparse
import datetime
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _benchmark as benchmark

HEADS, HEADS_KV, HEAD_DIM = 32, 8, 128
DECODE_BATCHES = (1, 8, 64, 256)
DECODE_SEQS = (2048, 4096, 16384, 32768, 131072)
MAX_TOKENS = 1 << 22  # 16 GiB of bf16 K / V at 8 kv heads of 128
PREFILL = ((2048, 16384), (2048, 65536))


def paged_inputs(batch, seq, new, page_size, seed=0):
  """q, pools and a shuffled page table for `batch` sequences of `seq`
  cached tokens (the last `new` of them the queries')."""
  pages = batch * (seq // page_size)
  keys = jax.random.split(jax.random.key(seed), 3)
  pool = (pages, page_size, HEADS_KV, HEAD_DIM)
  k_pages = jax.random.normal(keys[0], pool, jnp.bfloat16)
  v_pages = jax.random.normal(keys[1], pool, jnp.bfloat16)
  table = np.random.default_rng(seed).permutation(pages).astype(np.int32).reshape(batch, -1)
  q = jax.random.normal(keys[2], (batch, new, HEADS, HEAD_DIM), jnp.bfloat16)
  lengths = jnp.full((batch,), seq, jnp.int32)
  return q, k_pages, v_pages, jnp.asarray(table), lengths


def fp8_pools(k_pages, v_pages):
  """The pools as an FP8 cache: codes and scales per token and kv head."""
  return jax_flash.Fp8Pages.quantize(k_pages), jax_flash.Fp8Pages.quantize(v_pages)


def contiguous(pages, table):
  batch = table.shape[0]
  return pages[table].reshape(batch, -1, *pages.shape[2:])


def cudnn_paged(q, k_pages, v_pages, table, lengths):
  from jax._src.cudnn import fused_attention_stablehlo as cudnn
  tables = table[:, None, :, None]
  return cudnn.paged_attention(
      q, k_pages, v_pages, jnp.ones_like(lengths), lengths, tables, tables,
      scale=HEAD_DIM ** -0.5, mask_type=cudnn.MaskType.PADDING)


def pallas_paged(q, k_pages, v_pages, table, lengths):
  from jax.experimental.pallas.ops.gpu import paged_attention as pallas
  heads_first = lambda x: jnp.moveaxis(x, 2, 0)
  return pallas.paged_attention(q[:, 0] * HEAD_DIM ** -0.5, heads_first(k_pages),
                                heads_first(v_pages), table, lengths)


def flash_paged(split):
  return lambda q, k, v, t, n: jax_flash.paged_attention(q, k, v, t, n, kv_split_size=split,
                                                         implementation="flash")


def decode_impls(page_size, splits):
  """(impl, variant, fn(q, k_pages, v_pages, table, lengths)) per
  implementation; cuDNN's contiguous anchor reads keys gathered beforehand."""
  xla = lambda q, k, v, t, n: jax_flash.paged_attention(q, k, v, t, n, implementation="xla")
  dense = lambda q, k, v, t, n: jax.nn.dot_product_attention(
      q, k, v, key_value_seq_lengths=n, implementation="cudnn")
  return [("jax_flash", f"paged-split{split}", flash_paged(split)) for split in splits] + [
      ("cudnn", "paged", cudnn_paged),
      ("pallas", "paged", pallas_paged),
      ("xla", "gather", xla),
  ] + ([("cudnn", "contiguous", dense)] if page_size == 64 else [])


def memory_ceilings_gbps(gib: float = 4.0) -> tuple[float, float]:
  """(copy: read + write of a `gib` array, read: a sum over it), GB/s."""
  x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
  copy_ms = benchmark._time(jax.jit(lambda x: x + 1), (x,))
  read_ms = benchmark._time(jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32)), (x,))
  return 2 * x.nbytes / copy_ms / 1e6, x.nbytes / read_ms / 1e6


def row(impl, op, variant, batch, seq_q, seq_k, page_size, ms, gbps=None, tflops=None, **extra):
  return {"impl": impl, "op": op, "dtype": "bfloat16", "batch": batch, "seq_q": seq_q,
          "seq_k": seq_k, "heads_q": HEADS, "heads_kv": HEADS_KV, "head_dim": HEAD_DIM,
          "head_dim_v": HEAD_DIM, "causal": True, "window": None, "variant": variant,
          "tflops": tflops, "ms": round(ms, 4), "gbps": gbps, "page_size": page_size, **extra}


def run_decode(shapes, pages, splits, ceiling, kv_dtypes=("bfloat16",)):
  rows = []
  print(f"{'B':>4} {'S':>7} {'page':>5}  {'impl':<24}{'ms':>9}{'GB/s':>8}{'ceiling':>8}", flush=True)
  for batch, seq in shapes:
      if batch * seq > MAX_TOKENS:
        continue
      for page_size, kv_dtype in ((p, d) for p in pages for d in kv_dtypes):
        args = paged_inputs(batch, seq, 1, page_size)
        dense_args = (args[0], contiguous(args[1], args[3]), contiguous(args[2], args[3]),
                      args[3], args[4]) if page_size == 64 and kv_dtype == "bfloat16" else None
        impls = decode_impls(page_size, splits)
        kv_bytes = 2 * batch * seq * HEADS_KV * HEAD_DIM * 2
        if kv_dtype != "bfloat16":  # codes and a float32 scale per token and kv head
          args = (args[0], *fp8_pools(args[1], args[2]), *args[3:])
          impls = [("jax_flash", f"paged-split{split}", flash_paged(split)) for split in splits]
          kv_bytes = 2 * batch * seq * HEADS_KV * (HEAD_DIM + 4)
        for impl, variant, fn in impls:
          if impl == "xla" and batch * seq > MAX_TOKENS // 4:
            continue  # the gathered copy would not fit beside the pools
          try:
            ms = benchmark._time(jax.jit(fn), dense_args if variant == "contiguous" else args)
          except Exception as e:  # an anchor that rejects the shape is reported, not fatal
            print(f"{batch:>4} {seq:>7} {page_size:>5}  {impl + ':' + variant:<20}failed: "
                  f"{benchmark.error_summary(e)}", flush=True)
            continue
          gbps = kv_bytes / ms / 1e6
          name = impl + ":" + variant + ("" if kv_dtype == "bfloat16" else ":fp8")
          print(f"{batch:>4} {seq:>7} {page_size:>5}  {name:<24}{ms:9.4f}"
                f"{gbps:8.0f}{gbps / ceiling:8.2f}{batch * seq / ms / 1e6:8.2f} Gtok/s", flush=True)
          rows.append(row(impl, "paged_decode", variant, batch, 1, seq, page_size, ms,
                          gbps=round(gbps, 1), ceiling_fraction=round(gbps / ceiling, 3),
                          kv_dtype=kv_dtype, tokens_per_s=round(batch * seq / ms * 1e3)))
        del args
  return rows


def run_prefill(page_size, splits):
  rows = []
  for new, seq in PREFILL:
    q, k_pages, v_pages, table, lengths = paged_inputs(1, seq, new, page_size)
    # Query t (position seq - new + t) sees seq - new + t + 1 keys.
    flops = 4 * HEADS * HEAD_DIM * (new * (seq - new) + new * (new + 1) / 2)
    k, v = contiguous(k_pages, table), contiguous(v_pages, table)
    plans = [("jax_flash", f"paged-split{split}", jax.jit(flash_paged(split)),
              (q, k_pages, v_pages, table, lengths)) for split in splits] + [
        ("jax_flash", "contiguous", jax.jit(lambda q, k, v: jax_flash.attention(
            q, k, v, causal=True, implementation="flash")), (q, k, v)),
    ]
    for impl, variant, fn, args in plans:
      ms = benchmark._time(fn, args)
      tflops = flops / ms / 1e9
      print(f"prefill {new} x {seq} page {page_size}  {impl}:{variant:<12}{ms:9.4f} ms"
            f"{tflops:8.0f} TFLOPS", flush=True)
      rows.append(row(impl, "paged_prefill", variant, 1, new, seq, page_size, ms,
                      tflops=round(tflops, 1)))
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=list(DECODE_BATCHES))
  parser.add_argument("--seqs", type=int, nargs="+", default=list(DECODE_SEQS))
  parser.add_argument("--shapes", nargs="+", default=None,
                      help="BATCHxSEQ decode shapes instead of every --batches x --seqs")
  parser.add_argument("--pages", type=int, nargs="+", default=[16, 64])
  parser.add_argument("--split-sizes", type=int, nargs="+",
                      default=[jax_flash._paged.DEFAULT_KV_SPLIT_SIZE],
                      help="jax_flash kv_split_size values, a row each")
  parser.add_argument("--kv-dtypes", nargs="+", default=["bfloat16"],
                      choices=["bfloat16", "float8_e4m3fn"], help="the caches' types, rows each")
  parser.add_argument("--no-prefill", action="store_true", help="decode rows only")
  parser.add_argument("--out", type=pathlib.Path, help="results file to write (one run)")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    print("bench_paged: needs a GPU")
    return 2
  device = jax.devices()[0].device_kind
  ceiling, read = memory_ceilings_gbps()
  print(f"{device}, jax {jax.__version__}; copy ceiling {ceiling:.0f} GB/s, read {read:.0f} GB/s",
        flush=True)
  shapes = ([tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes
            else [(b, s) for b in args.batches for s in args.seqs])
  rows = run_decode(shapes, args.pages, args.split_sizes, ceiling, args.kv_dtypes)
  if not args.no_prefill:
    rows += run_prefill(64, args.split_sizes)
  if args.out:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    run = {"gpu": device, "jax": jax.__version__, "date": datetime.date.today().isoformat(),
           "commit": commit, "command": "python benchmarks/bench_paged.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "note": f"copy ceiling {ceiling:.0f} GB/s (read + write of a 4 GiB array), read "
                   f"{read:.0f} GB/s (a sum over it)"}
    args.out.write_text(json.dumps({"run": run, "rows": rows}, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
