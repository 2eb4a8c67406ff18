"""TFLOPS against sequence length, from benchmark rows (docs/numerics.md).

    python benchmarks/plot_results.py benchmarks/results/h100-2026-11-26-run121.json --out run121.png
    python benchmarks/plot_results.py gpu_out/bench.json --out sweep.png --run 3

One panel per head dim (or head dim pair, e.g. 192/128), the forward in the
top row and the backward below it. A line per implementation (with its
variant, and its dtype where the rows mix dtypes): solid without a mask,
dashed causal. The dotted grey line is the
matmul ceiling measured in the same run. A configuration measured more than
once is drawn from its last row, since the benchmarks append rows in order.
``benchmarks/bench_attention.py --plot`` draws its own rows the same way.
"""

import argparse
import pathlib
import statistics
import sys

from jax_flash import _benchmark as benchmark

OPS = ("fwd", "bwd")
OP_TITLES = {"fwd": "forward", "bwd": "backward"}
# Legend order; also fixed colours, so that these look the same in every figure.
IMPL_ORDER = ("jax_flash", "cudnn", "pallas_mgpu", "xla")


def series_name(row: dict, several_dtypes: bool) -> str:
  """The legend name of the line a row belongs to, without its mask."""
  name = row["impl"] + (f" [{row['variant']}]" if row.get("variant") else "")
  return name + (f" {row['dtype']}" if several_dtypes else "")


def collect_points(rows: list) -> dict:
  """``{(op, (head_dim, head_dim_v), series, causal): {seq: tflops}}`` from the rows that
  have TFLOPS (packed-document rows carry milliseconds only); later rows of
  the same configuration replace earlier ones, except that the rounds of one
  ``--rounds`` sweep (rows with ``round`` 1, 2, ... after round 0) give their
  median."""
  timed = [r for r in rows if r.get("op") in OPS and r.get("tflops") is not None]
  several_dtypes = len({r["dtype"] for r in timed}) > 1
  rounds = {}
  for row in timed:
    dims = (row["head_dim"], row.get("head_dim_v") or row["head_dim"])
    slot = (row["op"], dims, series_name(row, several_dtypes), row["causal"]), row["seq_q"]
    if row.get("round", 0) == 0:
      rounds[slot] = []
    rounds.setdefault(slot, []).append(row["tflops"])
  points = {}
  for (key, seq), values in rounds.items():
    points.setdefault(key, {})[seq] = statistics.median(values)
  return points


def size_label(count: int) -> str:
  return f"{count // 1024}k" if count % 1024 == 0 else str(count)


def describe(rows: list) -> str:
  """A figure title from what the rows have in common."""
  def values(field):
    return " / ".join(sorted({str(r[field]) for r in rows if r.get(field) is not None}))

  shapes = sorted({(r["batch"] * r["seq_q"], r["heads_q"]) for r in rows})
  shape_text = ", ".join(f"{size_label(tokens)} tokens x {heads} heads" for tokens, heads in shapes)
  return f"{values('gpu')}, jax {values('jax')}, {values('date')}: {shape_text}"


def series_order(name: str):
  """Sort key: the known implementations in IMPL_ORDER, then others by name."""
  impl = name.split()[0]
  return (IMPL_ORDER.index(impl) if impl in IMPL_ORDER else len(IMPL_ORDER), name)


def plot(rows: list, path) -> int:
  """Draws ``rows`` into the PNG at ``path``; returns how many lines it drew.
  Raises ImportError without matplotlib and ValueError without timed rows."""
  import matplotlib
  matplotlib.use("Agg")  # files only: no display on the GPU machines or in CI
  import matplotlib.pyplot as plt

  points = collect_points(rows)
  if not points:
    raise ValueError("no forward or backward rows with TFLOPS to plot")
  ops = [op for op in OPS if any(key[0] == op for key in points)]
  head_dims = sorted({key[1] for key in points})
  series = sorted({key[2] for key in points}, key=series_order)
  others = [name for name in series if name not in IMPL_ORDER]
  colours = {name: f"C{IMPL_ORDER.index(name)}" for name in series if name in IMPL_ORDER}
  colours.update({name: f"C{(len(IMPL_ORDER) + i) % 10}" for i, name in enumerate(others)})
  ceilings = sorted(r["matmul_ceiling_tflops"] for r in rows
                    if r.get("matmul_ceiling_tflops") and r.get("tflops") is not None)
  seqs = sorted({seq for curve in points.values() for seq in curve})

  fig, axes = plt.subplots(len(ops), len(head_dims), squeeze=False, sharex=True,
                           figsize=(4.5 * len(head_dims), 3.6 * len(ops) + 1.2),
                           layout="constrained")
  legend = {}
  for row_index, op in enumerate(ops):
    for column, head_dim in enumerate(head_dims):
      ax = axes[row_index][column]
      for name in series:
        for causal in (False, True):
          curve = points.get((op, head_dim, name, causal))
          if not curve:
            continue
          xs = sorted(curve)
          label = name + (", causal" if causal else "")
          (line,) = ax.plot(xs, [curve[x] for x in xs], color=colours[name], marker="o",
                            markersize=3, linestyle="--" if causal else "-")
          legend.setdefault(label, line)
      if ceilings:
        ceiling = ceilings[len(ceilings) // 2]
        line = ax.axhline(ceiling, color="grey", linestyle=":", linewidth=1)
        legend.setdefault(f"matmul ceiling ({ceiling:.0f} TFLOPS)", line)
      ax.set_xscale("log", base=2)
      ax.set_xticks(seqs, [size_label(s) for s in seqs])
      ax.set_ylim(bottom=0)
      ax.grid(True, alpha=0.3)
      dims = str(head_dim[0]) if head_dim[0] == head_dim[1] else f"{head_dim[0]}/{head_dim[1]}"
      ax.set_title(f"head dim {dims}, {OP_TITLES[op]}")
      if column == 0:
        ax.set_ylabel("TFLOPS")
      if row_index == len(ops) - 1:
        ax.set_xlabel("sequence length")
  fig.suptitle(describe(rows), fontsize=10)
  fig.legend(legend.values(), legend.keys(), loc="outside lower center",
             ncol=min(len(legend), 4), fontsize=8)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return len(points)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("results", type=pathlib.Path,
                      help="a results file (benchmarks/results/) or the JSON list of rows a "
                           "benchmark's --out writes")
  parser.add_argument("--out", type=pathlib.Path, help="PNG to write (default: RESULTS.png)")
  parser.add_argument("--run", type=int, help="only the rows of this run number")
  args = parser.parse_args(argv)

  rows = benchmark.read_rows(args.results)
  if args.run is not None:
    rows = [r for r in rows if r.get("run") == args.run]
    if not rows:
      print(f"{args.results} has no rows of run {args.run}")
      return 1
  out = args.out or args.results.with_suffix(".png")
  try:
    lines = plot(rows, out)
  except ValueError as e:
    print(f"{args.results}: {e}")
    return 1
  print(f"wrote {out} ({lines} lines)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
