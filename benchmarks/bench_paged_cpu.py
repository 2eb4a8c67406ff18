"""Paged KV-cache attention on the CPU: jax_flash's CPU kernel against the
XLA composition over gathered pages (``implementation="xla"``), in one
process.

    python benchmarks/bench_paged_cpu.py --out benchmarks/results/cpu-DATE-paged.json

The header's "gpu" is "cpu", the series the results tooling names the file
by (benchmarks/add_run.py: gpu_series); "cpu" holds the processor.

Each shape is a batch of sequences with the same cache length in a shuffled
page pool: ``paged_decode`` rows have one new token per sequence,
``paged_prefill`` rows a few (speculative tokens or a short chunk), causal
from each sequence's bottom right. ``gbps`` counts the cached K / V bytes
read once over the time. The implementations of one shape run in turn for
``--rounds`` rounds, each timing the median of a few loops; a row keeps the
fastest round, which other jobs on the machine disturb least.
"""

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _benchmark as benchmark

BATCH, HEADS, HEADS_KV, PAGE_SIZE = 8, 8, 2, 64
SEQS = (2048, 8192)
NEW_TOKENS = (1, 4)
HEAD_DIMS = (64, 128)
DTYPES = ("float32", "bfloat16")
IMPLS = {"jax_flash": None, "xla": "xla"}


def paged_inputs(batch, seq, new, head_dim, dtype, page_size, seed=0):
  """q, pools and a shuffled page table for `batch` sequences of `seq`
  cached tokens (the last `new` of them the queries')."""
  pages = batch * -(-seq // page_size)
  keys = jax.random.split(jax.random.key(seed), 3)
  pool = (pages, page_size, HEADS_KV, head_dim)
  k_pages = jax.random.normal(keys[0], pool, dtype)
  v_pages = jax.random.normal(keys[1], pool, dtype)
  table = np.random.default_rng(seed).permutation(pages).astype(np.int32).reshape(batch, -1)
  q = jax.random.normal(keys[2], (batch, new, HEADS, head_dim), dtype)
  lengths = jnp.full((batch,), seq, jnp.int32)
  return q, k_pages, v_pages, jnp.asarray(table), lengths


def attend(implementation):
  return jax.jit(lambda q, k, v, table, lengths: jax_flash.paged_attention(
      q, k, v, table, lengths, implementation=implementation))


def run(seqs, new_tokens, head_dims, dtypes, page_size, rounds):
  rows = []
  print(f"{'dtype':>9} {'hd':>4} {'S':>6} {'new':>4}  {'impl':<10}{'ms':>9}{'GB/s':>8}", flush=True)
  for dtype in dtypes:
    for head_dim in head_dims:
      for seq in seqs:
        for new in new_tokens:
          args = paged_inputs(BATCH, seq, new, head_dim, jnp.dtype(dtype), page_size)
          kv_bytes = 2 * BATCH * seq * HEADS_KV * head_dim * jnp.dtype(dtype).itemsize
          calls = {impl: attend(implementation) for impl, implementation in IMPLS.items()}
          times = {impl: float("inf") for impl in IMPLS}
          for _ in range(rounds):
            for impl, call in calls.items():
              times[impl] = min(times[impl], benchmark._time(call, args))
          for impl, ms in times.items():
            gbps = kv_bytes / ms / 1e6
            print(f"{dtype:>9} {head_dim:>4} {seq:>6} {new:>4}  {impl:<10}{ms:9.3f}{gbps:8.2f}",
                  flush=True)
            rows.append({
                "impl": impl, "op": "paged_decode" if new == 1 else "paged_prefill",
                "dtype": dtype, "batch": BATCH, "seq_q": new, "seq_k": seq, "heads_q": HEADS,
                "heads_kv": HEADS_KV, "head_dim": head_dim, "head_dim_v": head_dim,
                "causal": True, "window": None, "variant": "", "tflops": None,
                "ms": round(ms, 4), "gbps": round(gbps, 2), "page_size": page_size,
                "platform": "cpu"})
          print(f"{'':>27}xla / jax_flash: {times['xla'] / times['jax_flash']:.1f}x", flush=True)
  return rows



def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqs", type=int, nargs="+", default=list(SEQS))
  parser.add_argument("--new-tokens", type=int, nargs="+", default=list(NEW_TOKENS))
  parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
  parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
  parser.add_argument("--page-size", type=int, default=PAGE_SIZE)
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", type=pathlib.Path, help="results file to write (one run)")
  args = parser.parse_args(argv)
  cpu = jax.devices("cpu")[0]
  load = os.getloadavg()[0]  # other jobs share the cores: the results say how busy they were
  with jax.default_device(cpu):
    rows = run(args.seqs, args.new_tokens, args.head_dims, args.dtypes, args.page_size,
               args.rounds)
  if args.out:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    run_info = {"gpu": "cpu", "cpu": benchmark.processor_name(), "jax": jax.__version__,
                "date": datetime.date.today().isoformat(), "commit": commit,
                "command": "python benchmarks/bench_paged_cpu.py " + " ".join(
                    sys.argv[1:] if argv is None else argv),
                "note": f"{os.cpu_count()} CPU cores, load average {load:.1f} at the start; "
                        f"batch {BATCH}, {HEADS} query / {HEADS_KV} kv heads, page "
                        f"{args.page_size}, fastest of {args.rounds} rounds"}
    args.out.write_text(json.dumps({"run": run_info, "rows": rows}, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
