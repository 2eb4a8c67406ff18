"""Compiles one kernel family for one GPU architecture ahead of time.

    python -m cuda_src.export_kernels --family fwd_sm80 --arch sm_90a --out DIR

run from the repository root, runs the module ``cuda_src.<family>.export``
in a fresh interpreter (the CuTe DSL reads its target architecture once, at
import) into ``DIR/<family>_<arch>/`` and packs the resulting objects into
``DIR/lib<family>_<arch>.a`` for the linker. Used by CMake; also handy to
prebuild kernels for a machine that has no CuTe DSL (pass the folder as
``-DJAX_FLASH_AOT_DIR``).

In shards, so that the build tool runs them in parallel (CMake does):

    python -m cuda_src.export_kernels --family F --arch A --out DIR --shard 2/4   # each of 1/4 .. 4/4
    python -m cuda_src.export_kernels --family F --arch A --out DIR --combine 4

Shard i of n compiles every n-th variant of the family, starting at the
i-th, into ``DIR/<family>_<arch>.shards/<i>/``; the combine step gathers
them into ``DIR/<family>_<arch>/``, checks that they hold every variant the
generated header names, and packs the archive. A family's variants differ
in cost by head dim and kind, and export.py lists them by kind, dtype and
head dim, so taking every n-th one spreads them evenly. The split happens in
``cuda_src.common.export_common.export_variants``, the loop every family's
export.py hands its (name, compile) pairs to: a shard replaces it by one
that compiles its own share and returns every name, so that the header each
shard writes is the whole family's.

ptxas runs verbose: its report goes to ``DIR/<family>_<arch>/ptxas.log``, a
line per kernel (registers, spilled bytes) to the build output, and a
"Potential Performance Loss" advisory fails the build. Such advisories are
silent otherwise and expensive: one (setmaxnreg ignored for want of a
register count at entry) had the Hopper backward's warps compiled for 168
registers instead of 240 and its WGMMAs serialised. Where cuobjdump is
available, sass_checks.py also inspects the machine code.
"""

import argparse
import os
import pathlib
import re
import runpy
import shutil
import subprocess
import sys
import time

from . import sass_checks

# The package's folder: the shards run `python -m cuda_src.export_kernels` in
# the folder above it (a test points this at a copy of the package).
SOURCE_DIR = pathlib.Path(__file__).resolve().parent
# CuTe DSL compiler option: print ptxas's -v report as remarks.
PTXAS_REMARKS = "remarks{ptx}"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
# Printed by export_common.export_variants after each kernel.
EXPORTED = re.compile(r"^(\S+): compiled and exported in", re.M)
# The report is wrapped: an advisory runs until the next "ptxas" token.
ADVISORY = re.compile(r"Potential Performance Loss: (.*?)(?=ptxas|\Z)", re.S)


# Advisories seen and not yet fixed, by kernel: reported, not fatal. Any other
# advisory fails the build.
KNOWN_ADVISORIES = {}


def ptxas_summary(log: str):
  """[(kernel, registers, spilled bytes, [advisories])] from the export's
  output, each kernel's ptxas report being the text before its
  "compiled and exported" line."""
  rows, start = [], 0
  for match in EXPORTED.finditer(log):
    report = log[start:match.start()]
    registers = [int(r) for r in re.findall(r"Used (\d+) registers", report)]
    spilled = sum(int(b) for b in re.findall(r"(\d+) bytes spill stores", report))
    advisories = sorted({re.split(r" (?:for|in) the function", " ".join(a.split()))[0]
                         for a in ADVISORY.findall(report)})
    rows.append((match.group(1), max(registers, default=0), spilled, advisories))
    start = match.end()
  return rows


def unexpected_advisories(log: str) -> list:
  """Prints a line per kernel of the export's ptxas report and returns the
  advisories that KNOWN_ADVISORIES does not list, as "kernel: advisory"."""
  flagged = []
  for name, registers, spilled, advisories in ptxas_summary(log):
    print(f"jax_flash: {name}: {registers} registers, {spilled} bytes spilled")
    for advisory in advisories:
      if KNOWN_ADVISORIES.get(name) == advisory:
        print(f"jax_flash: {name}: known ptxas advisory: {advisory}")
      else:
        flagged.append(f"{name}: {advisory}")
  return flagged


def _shard_dir(family: str, arch: str, out: pathlib.Path, index: int) -> pathlib.Path:
  return out / f"{family}_{arch}.shards" / str(index)


def _done_stamp(family: str, arch: str, out: pathlib.Path, index: int) -> pathlib.Path:
  return out / f"{family}_{arch}.shards" / f"{index}.done"


def export_shard(family: str, arch: str, out: pathlib.Path, index: int, count: int) -> None:
  """Compiles shard index (1-based) of count of the family's variants and
  checks them (ptxas advisories, SASS); touches its .done stamp on success."""
  target = _shard_dir(family, arch, out, index)
  stamp = _done_stamp(family, arch, out, index)
  stamp.unlink(missing_ok=True)
  if target.exists():
    shutil.rmtree(target)
  target.mkdir(parents=True)
  env = dict(os.environ, CUTE_DSL_ARCH=arch)
  env["CUTE_DSL_COMPILER_OPT"] = f"{env.get('CUTE_DSL_COMPILER_OPT', '')} {PTXAS_REMARKS}".strip()
  # `python -m` finds the package in its working folder, which PYTHONSAFEPATH
  # (set where CI runs the tests) would leave off sys.path.
  env.pop("PYTHONSAFEPATH", None)
  start = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, "-m", f"{__package__}.export_kernels", "--worker", f"{index}/{count}",
       family, "--arch", arch, "--out", str(target.resolve())],
      env=env, cwd=SOURCE_DIR.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  log = ANSI_ESCAPE.sub("", proc.stdout)
  (target / "ptxas.log").write_text(log)
  label = f"{family} {arch}" + (f" [{index}/{count}]" if count > 1 else "")
  if proc.returncode != 0:
    print(log[-20000:])
    raise SystemExit(f"jax_flash: {label} export failed (exit {proc.returncode})")
  flagged = unexpected_advisories(log)
  if flagged:
    raise SystemExit("jax_flash: ptxas reports a potential performance loss (see "
                     f"{target / 'ptxas.log'}):\n  " + "\n  ".join(flagged))
  objects = sorted(target.glob("*.o"))
  problems = sass_checks.run(family, objects) if objects else None
  if problems:
    raise SystemExit("jax_flash: the machine code lost a property the kernels rely on for "
                     "speed (cuda_src/sass_checks.py):\n  " + "\n  ".join(problems))
  checked = ", SASS checks passed" if problems is not None else ""
  print(f"jax_flash: {label}: {len(objects)} kernels in {time.perf_counter() - start:.0f} s{checked}")
  stamp.touch()


def combine(family: str, arch: str, out: pathlib.Path, count: int) -> pathlib.Path:
  """Gathers the shards into out/<family>_<arch>/ and packs
  out/lib<family>_<arch>.a; fails unless the shards hold exactly the
  variants the family's header names."""
  target = out / f"{family}_{arch}"
  if target.exists():
    shutil.rmtree(target)
  target.mkdir(parents=True)
  header_name = f"{family}_variants_{arch}.h"
  headers, logs = set(), []
  for index in range(1, count + 1):
    shard = _shard_dir(family, arch, out, index)
    if not _done_stamp(family, arch, out, index).exists():
      raise SystemExit(f"jax_flash: {family} {arch}: shard {index}/{count} has not finished")
    headers.add((shard / header_name).read_text())
    logs.append(f"==== shard {index}/{count}\n" + (shard / "ptxas.log").read_text())
    for path in shard.iterdir():
      if path.suffix in (".o", ".h") and path.name != header_name:
        shutil.copy2(path, target / path.name)
  if len(headers) != 1:
    raise SystemExit(f"jax_flash: {family} {arch}: the shards wrote different {header_name}s")
  header = headers.pop()
  (target / header_name).write_text(header)
  (target / "ptxas.log").write_text("".join(logs))
  named = set(re.findall(r'^#include "(\w+)\.h"', header, re.M))
  exported = {path.stem for path in target.glob("*.o")}
  if not named or named != exported:
    raise SystemExit(f"jax_flash: {family} {arch}: {header_name} names {len(named)} variants, the "
                     f"shards exported {len(exported)}; missing: {sorted(named - exported)}, "
                     f"unnamed: {sorted(exported - named)}")
  if family in sass_checks.CHECKS and sass_checks.find_cuobjdump() is None:
    print(f"jax_flash: {family}: SASS checks skipped (no cuobjdump on PATH or in $CUOBJDUMP)")
  archive = out / f"lib{family}_{arch}.a"
  archive.unlink(missing_ok=True)
  subprocess.run(["ar", "rcs", str(archive), *map(str, sorted(target.glob("*.o")))], check=True)
  print(f"jax_flash: {family} {arch}: {len(exported)} kernels packed into {archive.name}")
  return archive


def export(family: str, arch: str, out: pathlib.Path) -> pathlib.Path:
  """The whole family in one process: one shard, combined."""
  export_shard(family, arch, out, 1, 1)
  return combine(family, arch, out, 1)


def run_worker(shard: str, family: str, argv: list) -> None:
  """In the shard's own interpreter: runs the family's export module as
  __main__, with export_common.export_variants compiling only this shard's
  share of the variants (see the module docstring)."""
  index, count = map(int, shard.split("/"))
  from .common import export_common

  export_all = export_common.export_variants
  calls = []

  def export_share(out_dir, variants):
    variants = list(variants)
    calls.append(len(variants))
    export_all(out_dir, variants[index - 1::count])
    return [name for name, _ in variants]

  export_common.export_variants = export_share
  module = f"{__package__}.{family}.export"
  sys.argv = [module, *argv]
  runpy.run_module(module, run_name="__main__")
  if len(calls) != 1:
    raise SystemExit(f"jax_flash: {module} called common.export_common.export_variants "
                     f"{len(calls)} times; the shards split exactly one call")


def main() -> None:
  if sys.argv[1:2] == ["--worker"]:
    run_worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    return
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--family", required=True, help="kernel folder under cuda_src, e.g. fwd_sm80")
  parser.add_argument("--arch", required=True, choices=["sm_80", "sm_90a"])
  parser.add_argument("--out", required=True, type=pathlib.Path)
  mode = parser.add_mutually_exclusive_group()
  mode.add_argument("--shard", metavar="I/N", help="compile the I-th of N shards (1-based)")
  mode.add_argument("--combine", metavar="N", type=int, help="gather N finished shards and pack them")
  args = parser.parse_args()
  if args.shard:
    index, count = map(int, args.shard.split("/"))
    if not 1 <= index <= count:
      parser.error(f"--shard {args.shard}: I must be within 1..N")
    export_shard(args.family, args.arch, args.out, index, count)
  elif args.combine:
    combine(args.family, args.arch, args.out, args.combine)
  else:
    export(args.family, args.arch, args.out)


if __name__ == "__main__":
  main()
