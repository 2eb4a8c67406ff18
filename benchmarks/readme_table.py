"""The README's performance table, made from one results file.

    python benchmarks/readme_table.py            # prints the table of the newest full run
    python benchmarks/readme_table.py --write    # and puts it into README.md
    python benchmarks/readme_table.py --run benchmarks/results/h100-2026-11-27-run169.json

Per head dim: jax_flash's and cuDNN's forward and backward TFLOPS (bf16,
non-causal / causal), jax_flash's ratio to cuDNN, and the deterministic
backward over the default one where the run timed it. A run of several
rounds gives the median of each. The newest full run is the newest results
file holding forward and backward rows of both jax_flash and cuDNN.
"""

import argparse
import pathlib
import re
import statistics
import sys

from jax_flash import _benchmark as benchmark

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN = "<!-- performance table: python benchmarks/readme_table.py --write -->"
END = "<!-- end of performance table -->"
DETERMINISTIC = "deterministic"


def is_full(rows: list) -> bool:
  timed = {(row["impl"], row["op"]) for row in rows
           if row.get("tflops") and row["variant"] == "" and row["dtype"] == "bfloat16"}
  return {(impl, op) for impl in ("jax_flash", "cudnn") for op in ("fwd", "bwd")} <= timed


def newest_full_run(directory=RESULTS) -> pathlib.Path:
  runs = [(header["date"], header.get("number", 0), path)
          for path, header, rows in benchmark.read_runs(directory) if is_full(rows)]
  if not runs:
    raise SystemExit(f"no results file in {directory} has forward and backward rows of jax_flash "
                     "and cuDNN")
  return max(runs)[2]


def medians(rows: list, seq: int) -> dict:
  """``{(impl, variant, op, (head_dim, head_dim_v), causal): median TFLOPS}``
  over the bf16 rows at ``seq``."""
  samples = {}
  for row in rows:
    if row["dtype"] == "bfloat16" and row["seq_q"] == seq and row.get("tflops"):
      dims = (row["head_dim"], row["head_dim_v"])
      key = (row["impl"], row["variant"], row["op"], dims, row["causal"])
      samples.setdefault(key, []).append(row["tflops"])
  return {key: statistics.median(values) for key, values in samples.items()}


def the_command(command: str | None) -> str:
  """The benchmark call of a run's command, without how the build got there."""
  found = re.search(r"bench_attention\.py[^;,]*", command or "")
  if found:
    return f"python benchmarks/{found.group(0).strip()}"
  return command or "(command not recorded)"


def table(path, seq: int = 8192) -> str:
  rows = benchmark.read_rows(path)
  header = rows[0]
  tflops = medians(rows, seq)
  if not tflops:
    raise SystemExit(f"{path} has no bf16 rows at seq {seq}")
  dims_all = sorted({key[3] for key in tflops}, key=lambda dims: (dims[0] != dims[1], dims[0]))
  rounds = 1 + max(row.get("round", 0) for row in rows)
  shapes = {(row["batch"], row["heads_q"]) for row in rows if row["seq_q"] == seq}
  (batch, heads), = shapes if len(shapes) == 1 else [(None, None)]
  has_deterministic = any(key[1] == DETERMINISTIC for key in tflops)

  def pair(impl, op, dims, variant=""):
    values = [tflops.get((impl, variant, op, dims, causal)) for causal in (False, True)]
    return values if None not in values else None

  def both(values, digits=0):
    return " / ".join(f"{value:.{digits}f}" for value in values) if values else "-"

  columns = ["head dim", "jax_flash fwd", "cuDNN fwd", "jax_flash bwd", "cuDNN bwd"]
  lines = []
  for dims in dims_all:
    cells = [str(dims[0]) if dims[0] == dims[1] else f"{dims[0]} / {dims[1]}"]
    for op in ("fwd", "bwd"):
      ours, theirs = pair("jax_flash", op, dims), pair("cudnn", op, dims)
      ratio = f" ({both([a / b for a, b in zip(ours, theirs)], 2)})" if ours and theirs else ""
      cells += [both(ours) + ratio, both(theirs)]
    if has_deterministic:
      default, deterministic = pair("jax_flash", "bwd", dims), pair("jax_flash", "bwd", dims,
                                                                      DETERMINISTIC)
      ratios = [a / b for a, b in zip(deterministic, default)] if default and deterministic else None
      cells.append(both(ratios, 2))
    lines.append("| " + " | ".join(cells) + " |")
  if has_deterministic:
    columns.append("deterministic bwd")
  shape = f"batch {batch} x seq {seq}, {heads} heads" if batch else f"seq {seq}"
  caption = (f"{header['gpu']}, JAX {header['jax']}, {header['date']}; bf16, {shape}; "
             f"TFLOPS non-causal / causal, jax_flash's ratio to cuDNN in brackets"
             + ("; the deterministic backward's TFLOPS over the default's" if has_deterministic
                else "")
             + f". {'Medians of ' + str(rounds) + ' rounds' if rounds > 1 else 'One timing'} "
             f"with cuDNN timed in the same run: `{the_command(header.get('command'))}` "
             f"(`benchmarks/results/{pathlib.Path(path).name}`).")
  return "\n".join([caption, "", "| " + " | ".join(columns) + " |",
                    "|" + "---|" * len(columns), *lines])


def write_into(readme: pathlib.Path, text: str) -> None:
  content = readme.read_text()
  if content.count(BEGIN) != 1 or content.count(END) != 1:
    raise SystemExit(f"{readme} needs one {BEGIN!r} line and one {END!r} line")
  before, rest = content.split(BEGIN)
  _, after = rest.split(END)
  readme.write_text(f"{before}{BEGIN}\n{text}\n{END}{after}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--run", type=pathlib.Path, help="results file (default: the newest full run)")
  parser.add_argument("--seq", type=int, default=8192, help="sequence length of the table's rows")
  parser.add_argument("--write", action="store_true", help=f"replace the table in {README.name}")
  args = parser.parse_args(argv)
  text = table(args.run or newest_full_run(), args.seq)
  print(text)
  if args.write:
    write_into(README, text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
