"""Files the rows a benchmark wrote (its ``--out``) as the next run in benchmarks/results/.

    python benchmarks/add_run.py gpu_out/bench.json --commit 45da411 \
        --command "bench_attention.py --impls jax_flash cudnn --rounds 3 --seqs 8192" \
        --note "what this run measured and on which build"

Writes ``benchmarks/results/<gpu>-<date>-run<number>.json`` (docs/numerics.md,
"Results format"): the header holds what the rows share, each row its
configuration and numbers. The number is one more than the highest of the
same GPU's runs in that folder.
"""

import argparse
import pathlib
import re
import sys

from jax_flash import _benchmark as benchmark

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def gpu_series(gpu: str, num_gpus: int = 1) -> str:
  """``NVIDIA H100 80GB HBM3`` -> ``h100``; with 4 GPUs ``h100x4``."""
  model = re.search(r"\b([A-Z]+\d+[A-Z]?)\b", gpu.removeprefix("NVIDIA "))
  name = model.group(1).lower() if model else re.sub(r"\W+", "-", gpu.lower()).strip("-")
  return name + (f"x{num_gpus}" if num_gpus > 1 else "")


def next_number(series: str, directory: pathlib.Path) -> int:
  numbers = [int(m.group(1)) for path in directory.glob(f"{series}-*-run*.json")
             if (m := re.fullmatch(rf"{re.escape(series)}-[\d-]+-run(\d+)\.json", path.name))]
  return max(numbers, default=0) + 1


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("rows", type=pathlib.Path, help="JSON list of rows a benchmark's --out wrote")
  parser.add_argument("--command", required=True, help="the command that made the rows")
  parser.add_argument("--note", required=True, help="what the run measured, on which build")
  parser.add_argument("--commit", help="the commit the kernels were built from")
  parser.add_argument("--results", type=pathlib.Path, default=RESULTS, help="folder of results files")
  args = parser.parse_args(argv)

  rows = benchmark.read_rows(args.rows)
  if not rows:
    parser.error(f"{args.rows} holds no rows")
  series = gpu_series(rows[0]["gpu"], max(row.get("num_gpus", 1) for row in rows))
  number = next_number(series, args.results)
  header = benchmark.run_header(rows, number, args.commit, args.command, args.note)
  path = args.results / f"{series}-{header['date']}-run{number:03d}.json"
  path.write_text(benchmark.run_document(header, rows))
  print(f"wrote {len(rows)} rows to {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
