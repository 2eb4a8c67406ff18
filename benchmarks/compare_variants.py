"""Kernel alternatives timed in turn (scripts/gpu_alternatives.sh): per
configuration, cuDNN's median and each library's median [min-max] TFLOPS
over its rounds, so that a difference can be read against the spread of the
shipped build's own timings.

    python benchmarks/compare_variants.py gpu_out/alternatives.json

jax_flash rows name their library and round in the variant ("shipped-2",
"tree4-1"); rows without a round count as round 1. bench_attention.py's
option rows ("shipped-2-deterministic", "shipped-2-softcap-20") count as a
library of their own ("shipped:deterministic").
"""

import argparse
import collections
import json
import pathlib
import re
import statistics
import sys


OPTION_SUFFIX = re.compile(r"-(deterministic|softcap-[^-]+)$")


def library_of(row: dict) -> str:
  """The library a row timed: cuDNN, or the jax_flash variant without its
  round (and ":option" for bench_attention.py's option rows)."""
  if row["impl"] != "jax_flash":
    return row["impl"]
  variant, option = row.get("variant") or "shipped", ""
  if match := OPTION_SUFFIX.search(variant):
    variant, option = variant[:match.start()], ":" + match.group(1)
  name, _, round_number = variant.rpartition("-")
  return (name if name and round_number.isdigit() else variant) + option


def timings(rows: list) -> dict:
  """``{(head_dim, head_dim_v, seq_q, causal, op): {library: [tflops, ...]}}``."""
  table = collections.defaultdict(lambda: collections.defaultdict(list))
  for row in rows:
    if row.get("tflops") is None:
      continue
    dims = (row["head_dim"], row.get("head_dim_v") or row["head_dim"])
    table[(*dims, row["seq_q"], row["causal"], row["op"])][library_of(row)].append(row["tflops"])
  return table


def format_table(table: dict) -> str:
  """One line per configuration: cuDNN first, then the libraries in name
  order with "shipped" first."""
  libraries = sorted({lib for cell in table.values() for lib in cell} - {"cudnn"},
                     key=lambda lib: (lib != "shipped", lib))
  head = f"{'configuration':24s} {'cudnn':>6s} " + " ".join(f"{lib:>16s}" for lib in libraries)
  lines = [head]
  for (head_dim, head_dim_v, seq, causal, op), cell in sorted(table.items()):
    dims = f"hd{head_dim}" + (f"/{head_dim_v}" if head_dim_v != head_dim else "")
    name = f"{dims} {seq} {'causal' if causal else 'full'} {op}"
    cudnn = f"{statistics.median(cell['cudnn']):6.0f}" if cell.get("cudnn") else f"{'-':>6s}"
    cells = []
    for lib in libraries:
      values = cell.get(lib)
      text = f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]" if values else "-"
      cells.append(f"{text:>16s}")
    lines.append(f"{name:24s} {cudnn} " + " ".join(cells))
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("rows", type=pathlib.Path, help="JSON rows of bench_attention.py --out")
  args = parser.parse_args(argv)
  table = timings(json.loads(args.rows.read_text()))
  if not table:
    print(f"no timed rows in {args.rows}", file=sys.stderr)
    return 1
  print(format_table(table))
  return 0


if __name__ == "__main__":
  sys.exit(main())
