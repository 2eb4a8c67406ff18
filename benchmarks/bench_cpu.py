"""Attention on the CPU: jax_flash's CPU kernels against the XLA composition.

    python benchmarks/bench_cpu.py --out benchmarks/results/cpu-DATE-attention.json
    python benchmarks/bench_cpu.py --seqs 512 2048 8192 16384 --threads all   # more sizes

Compared in one process per thread setting, in turn within each round:
``jax_flash`` (``implementation="cpu"``) and two XLA compositions, rows of
impl ``xla``: ``jax.nn.dot_product_attention(implementation="xla")``
(variant ``jax.nn``) and ``jax_flash.attention(implementation="xla")``
(variant ``jax_flash.xla``, the same maths with the library's NaN
semantics). ``fwd`` rows time the forward; ``bwd`` rows time
``jax.value_and_grad`` over q, k and v less the forward (GFLOPS count 2.5x
the forward's, as bench_attention.py does). Each row holds the median of
``--rounds`` rounds, each round the median of a few loops (one call where
a call alone lasts 0.3 s); ``vs_xla`` in
the jax_flash rows is the faster XLA's time over jax_flash's.

Problems hold ``--tokens`` query rows (batch 1, heads = tokens / seq, at
least 1), so every sequence length costs about the same per key. Peak
memory is what XLA's buffer assignment reserves for the compiled function
(``memory_analysis()``: arguments + outputs + temporaries, the largest set
live at once), measured for every size in ``--memory-seqs`` even where it
is not timed; the CPU kernels allocate nothing outside it (their tiles live
on the worker threads' stacks, < 300 KiB each). A size that fails to
compile or run (out of memory) leaves a row with ``error``.

Thread settings: ``all`` uses every core; ``1`` restricts the process to
one CPU (sched_setaffinity) before JAX starts, so XLA's thread pools and
the kernels (which use the CPUs the process may run on) both get one. Each
setting runs in a child process of this script; the header keeps the load
average at the start (the machine may be shared).
"""

import argparse
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

SEQS = (512, 2048, 8192)
MEMORY_SEQS = (16384,)
TOKENS = 8192
HEAD_DIMS = (64, 128)
DTYPES = ("float32", "bfloat16")
THREADS = ("all", "1")
BACKWARD_FLOP_FACTOR = 2.5
ROOT = pathlib.Path(__file__).resolve().parents[1]


def implementations(jax, jax_flash):
  """(impl, variant, attend(q, k, v, causal))."""
  return (
      ("jax_flash", "", lambda q, k, v, causal: jax_flash.attention(
          q, k, v, causal=causal, implementation="cpu")),
      ("xla", "jax.nn", lambda q, k, v, causal: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="xla")),
      ("xla", "jax_flash.xla", lambda q, k, v, causal: jax_flash.attention(
          q, k, v, causal=causal, implementation="xla")),
  )


def forward_flops(heads, seq, head_dim, causal):
  flops = 4.0 * heads * seq * seq * head_dim
  return flops / 2 if causal else flops


def time_ms(fn, args, loops=3, seconds=0.3):
  """Milliseconds per call: the median of `loops` loops sized to last about
  `seconds` in all, or one call where a call alone lasts longer."""
  import jax

  start = time.perf_counter()
  jax.block_until_ready(fn(*args))
  once = (time.perf_counter() - start) * 1e3
  if once >= seconds * 1e3:
    return once
  calls = max(1, round(seconds * 1e3 / loops / once))
  samples = []
  for _ in range(loops):
    start = time.perf_counter()
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) * 1e3 / calls)
  return statistics.median(samples)


def peak_bytes(compiled) -> int:
  memory = compiled.memory_analysis()
  return (memory.argument_size_in_bytes + memory.output_size_in_bytes +
          memory.temp_size_in_bytes - memory.alias_size_in_bytes)


def error_text(error: Exception) -> str:
  lines = str(error).splitlines() or [""]
  return f"{type(error).__name__}: {lines[0]}"[:160]


def measure_config(jax, jnp, impls, dtype, head_dim, seq, causal, rounds, timed):
  """Rows of one configuration: every implementation's fwd and bwd."""
  heads = max(1, TOKENS_PER_PROBLEM // seq)
  keys = jax.random.split(jax.random.key(0), 4)
  shape = (1, seq, heads, head_dim)
  q, k, v, dout = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys)
  compiled, results = {}, {}
  for impl, variant, attend in impls:
    forward = lambda q, k, v, attend=attend: attend(q, k, v, causal)
    loss = lambda q, k, v, dout, forward=forward: jnp.vdot(
        forward(q, k, v).astype(jnp.float32), dout.astype(jnp.float32))
    both = jax.value_and_grad(loss, argnums=(0, 1, 2))
    for op, fn, args in (("fwd", forward, (q, k, v)), ("bwd", both, (q, k, v, dout))):
      key = (impl, variant, op)
      results[key] = {"ms": [], "peak": None, "error": None}
      try:
        compiled[key] = jax.jit(fn).lower(*args).compile()
        results[key]["peak"] = peak_bytes(compiled[key])
      except Exception as e:  # noqa: BLE001 - out of memory at compile time is a result
        results[key]["error"] = error_text(e)
  if timed:
    args = {"fwd": (q, k, v), "bwd": (q, k, v, dout)}
    for key, function in compiled.items():  # the first call of each
      if results[key]["error"] is None:
        try:
          jax.block_until_ready(function(*args[key[2]]))
        except Exception as e:  # noqa: BLE001 - out of memory at run time is a result
          results[key]["error"] = error_text(e)
    for _ in range(rounds):
      for impl, variant, _ in impls:
        for op in ("fwd", "bwd"):
          key = (impl, variant, op)
          if results[key]["error"] is None:
            try:
              results[key]["ms"].append(time_ms(compiled[key], args[op]))
            except Exception as e:  # noqa: BLE001 - out of memory at run time is a result
              results[key]["error"] = error_text(e)
  flops = forward_flops(heads, seq, head_dim, causal)
  rows = []
  for impl, variant, _ in impls:
    fwd, total = results[(impl, variant, "fwd")], results[(impl, variant, "bwd")]
    for op in ("fwd", "bwd"):
      result = results[(impl, variant, op)]
      ms = None
      if result["ms"] and result["error"] is None:
        ms = statistics.median(result["ms"])
        if op == "bwd":
          if fwd["ms"] and fwd["error"] is None:
            ms = max(ms - statistics.median(fwd["ms"]), 1e-6)
          else:
            ms = None
      op_flops = flops * (BACKWARD_FLOP_FACTOR if op == "bwd" else 1.0)
      row = {
          "impl": impl, "op": op, "dtype": dtype, "batch": 1, "seq_q": seq, "seq_k": seq,
          "heads_q": heads, "heads_kv": heads, "head_dim": head_dim, "head_dim_v": head_dim,
          "causal": causal, "window": None, "variant": variant,
          "tflops": None if ms is None else round(op_flops / ms / 1e9, 5),
          "ms": None if ms is None else round(ms, 3), "gbps": None, "platform": "cpu",
          "gflops": None if ms is None else round(op_flops / ms / 1e6, 1),
          "peak_mib": None if result["peak"] is None else round(result["peak"] / 2**20, 2),
      }
      if op == "bwd" and ms is not None:
        row["fwd_bwd_ms"] = round(statistics.median(total["ms"]), 3)
      if result["error"]:
        row["error"] = result["error"]
      rows.append(row)
  return rows


def add_ratios(rows):
  """vs_xla (faster XLA ms / jax_flash ms) and mem_vs_xla (smallest XLA peak
  / jax_flash peak) in each jax_flash row."""
  def key(row):
    return (row["op"], row["dtype"], row["seq_q"], row["head_dim"], row["causal"])

  xla = {}
  for row in rows:
    if row["impl"] == "xla":
      best = xla.setdefault(key(row), {"ms": None, "peak": None})
      if row["ms"] is not None:
        best["ms"] = min(filter(None, (best["ms"], row["ms"])))
      if row["peak_mib"] is not None:
        best["peak"] = min(filter(None, (best["peak"], row["peak_mib"])))
  for row in rows:
    if row["impl"] == "jax_flash" and key(row) in xla:
      best = xla[key(row)]
      if row["ms"] and best["ms"]:
        row["vs_xla"] = round(best["ms"] / row["ms"], 3)
      if row["peak_mib"] and best["peak"]:
        row["mem_vs_xla"] = round(best["peak"] / row["peak_mib"], 1)


def print_header(threads):
  print(f"threads {threads}")
  print(f"{'dtype':>9} {'hd':>4} {'seq':>6} {'causal':>6} {'op':>4}  {'jax_flash':>10}"
        f"{'jax.nn':>10}{'jf.xla':>10}{'ratio':>7}  {'peak MiB jf / xla':>18}")


def print_rows(rows):
  cells = {}
  for row in rows:
    key = (row["dtype"], row["head_dim"], row["seq_q"], row["causal"], row["op"])
    cells.setdefault(key, {})[row["variant"] or row["impl"]] = row
  for (dtype, hd, seq, causal, op), by in cells.items():
    gf = lambda name: (f"{by[name]['gflops']:10.1f}" if by[name]["gflops"] is not None
                       else f"{'err' if 'error' in by[name] else '-':>10}")
    jf = by["jax_flash"]
    ratio = f"{jf['vs_xla']:7.2f}" if "vs_xla" in jf else f"{'-':>7}"
    peaks = (f"{jf['peak_mib'] or 0:8.1f} / {by['jax.nn']['peak_mib'] or 0:8.1f}")
    print(f"{dtype:>9} {hd:>4} {seq:>6} {causal!s:>6} {op:>4}  {gf('jax_flash')}"
          f"{gf('jax.nn')}{gf('jax_flash.xla')}{ratio}  {peaks:>18}", flush=True)


def child(args) -> int:
  """One thread setting in this process: prints its rows as JSON last."""
  if args.threads != "all":
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, allowed[:int(args.threads)])
  import jax
  import jax.numpy as jnp

  import jax_flash

  global TOKENS_PER_PROBLEM
  TOKENS_PER_PROBLEM = args.tokens
  impls = implementations(jax, jax_flash)
  rows = []
  print_header(args.threads)
  with jax.default_device(jax.devices("cpu")[0]):
    for dtype in args.dtypes:
      for head_dim in args.head_dims:
        for seq in sorted(set(args.seqs) | set(args.memory_seqs)):
          for causal in (False, True):
            config_rows = measure_config(jax, jnp, impls, dtype, head_dim, seq, causal,
                                         args.rounds, timed=seq in args.seqs)
            for row in config_rows:
              row["threads"] = len(os.sched_getaffinity(0))
            add_ratios(config_rows)
            print_rows(config_rows)
            rows += config_rows
  print("ROWS " + json.dumps({"jax": jax.__version__, "rows": rows}), flush=True)
  return 0



def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seqs", type=int, nargs="+", default=list(SEQS), help="timed lengths")
  parser.add_argument("--memory-seqs", type=int, nargs="*", default=list(MEMORY_SEQS),
                      help="lengths whose peak memory is measured without timing")
  parser.add_argument("--tokens", type=int, default=TOKENS,
                      help="query rows per problem (heads = tokens / seq)")
  parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
  parser.add_argument("--dtypes", nargs="+", default=list(DTYPES))
  parser.add_argument("--threads", nargs="+", default=list(THREADS), help="'all' or a count")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", type=pathlib.Path, help="results file to write (one run)")
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    [args.threads] = args.threads
    return child(args)

  load = os.getloadavg()
  started = datetime.date.today().isoformat()
  rows, jax_version = [], None
  forwarded = [a for a in (sys.argv[1:] if argv is None else argv)]
  for threads in args.threads:
    command = [sys.executable, __file__, "--child", "--threads", threads,
               *_without(forwarded, "--out", "--threads")]
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as proc:
      for line in proc.stdout:
        if line.startswith("ROWS "):
          lines.append(line[5:])
        else:
          print(line, end="", flush=True)
    if proc.returncode != 0 or not lines:
      print(f"threads {threads}: the child process failed ({proc.returncode})", file=sys.stderr)
      return 1
    result = json.loads(lines[-1])
    jax_version = result["jax"]
    rows += result["rows"]
  if args.out:
    sys.path.insert(0, str(ROOT))
    from jax_flash import _benchmark as benchmark

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip() or None
    run_info = {
        "gpu": "cpu", "cpu": benchmark.processor_name(), "jax": jax_version, "date": started,
        "commit": commit,
        "command": "python benchmarks/bench_cpu.py " + " ".join(forwarded),
        "note": f"{os.cpu_count()} CPU cores; load average {load[0]:.1f} / {load[1]:.1f} / "
                f"{load[2]:.1f} (1 / 5 / 15 min) at the start, {os.getloadavg()[0]:.1f} at "
                f"the end; batch 1, {args.tokens} query rows per problem; medians of "
                f"{args.rounds} rounds; peak_mib from XLA's memory_analysis() (arguments + "
                "outputs + temporaries)"}
    args.out.write_text(benchmark.run_document(run_info, rows))
    print(f"wrote {len(rows)} rows to {args.out}")
  return 0


def _without(argv, *options):
  """argv less the given options and their values."""
  out, skip = [], False
  for a in argv:
    if a.startswith("--"):
      skip = a in options
    if not skip:
      out.append(a)
  return out


TOKENS_PER_PROBLEM = TOKENS

if __name__ == "__main__":
  sys.exit(main())
