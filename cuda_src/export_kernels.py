"""Compiles one kernel family for one GPU architecture ahead of time.

    python cuda_src/export_kernels.py --family fwd_sm80 --arch sm_90a --out DIR

runs ``cuda_src/<family>/export.py`` in a fresh interpreter (the CuTe DSL
reads its target architecture once, at import) into ``DIR/<family>_<arch>/``
and packs the resulting objects into ``DIR/lib<family>_<arch>.a`` for the
linker. Used by CMake; also handy to prebuild kernels for a machine that has
no CuTe DSL (pass the folder as ``-DJAX_FLASH_AOT_DIR``).

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
import shutil
import subprocess
import sys
import time

import sass_checks

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


def export(family: str, arch: str, out: pathlib.Path) -> pathlib.Path:
  target = out / f"{family}_{arch}"
  if target.exists():
    shutil.rmtree(target)
  target.mkdir(parents=True)
  env = dict(os.environ, CUTE_DSL_ARCH=arch)
  env["CUTE_DSL_COMPILER_OPT"] = f"{env.get('CUTE_DSL_COMPILER_OPT', '')} {PTXAS_REMARKS}".strip()
  start = time.perf_counter()
  proc = subprocess.run(
      [sys.executable, str(SOURCE_DIR / family / "export.py"), "--arch", arch, "--out", str(target)],
      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  log = ANSI_ESCAPE.sub("", proc.stdout)
  (target / "ptxas.log").write_text(log)
  if proc.returncode != 0:
    print(log[-20000:])
    raise SystemExit(f"jax_flash: {family} export for {arch} failed (exit {proc.returncode})")
  flagged = unexpected_advisories(log)
  if flagged:
    raise SystemExit("jax_flash: ptxas reports a potential performance loss (see "
                     f"{target / 'ptxas.log'}):\n  " + "\n  ".join(flagged))
  objects = sorted(target.glob("*.o"))
  if not objects:
    raise SystemExit(f"jax_flash: {family} export for {arch} produced no object files")
  problems = sass_checks.run(family, objects)
  if problems:
    raise SystemExit("jax_flash: the machine code lost a property the kernels rely on for "
                     "speed (cuda_src/sass_checks.py):\n  " + "\n  ".join(problems))
  if problems is None and family in sass_checks.CHECKS:
    print(f"jax_flash: {family}: SASS checks skipped (no cuobjdump on PATH or in $CUOBJDUMP)")
  elif problems is not None:
    print(f"jax_flash: {family} {arch}: SASS checks passed")
  archive = out / f"lib{family}_{arch}.a"
  archive.unlink(missing_ok=True)
  subprocess.run(["ar", "rcs", str(archive), *map(str, objects)], check=True)
  print(f"jax_flash: {family} {arch}: {len(objects)} kernels in {time.perf_counter() - start:.0f} s")
  return archive


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--family", required=True, help="kernel folder under cuda_src, e.g. fwd_sm80")
  parser.add_argument("--arch", required=True, choices=["sm_80", "sm_90a"])
  parser.add_argument("--out", required=True, type=pathlib.Path)
  args = parser.parse_args()
  export(args.family, args.arch, args.out)


if __name__ == "__main__":
  main()
