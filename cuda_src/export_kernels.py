"""Compiles one kernel family for one GPU architecture ahead of time.

    python cuda_src/export_kernels.py --family fwd_sm80 --arch sm_90a --out DIR

runs ``cuda_src/<family>/export.py`` in a fresh interpreter (the CuTe DSL
reads its target architecture once, at import) into ``DIR/<family>_<arch>/``
and packs the resulting objects into ``DIR/lib<family>_<arch>.a`` for the
linker. Used by CMake; also handy to prebuild kernels for a machine that has
no CuTe DSL (pass the folder as ``-DJAX_FLASH_AOT_DIR``).
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import time

SOURCE_DIR = pathlib.Path(__file__).resolve().parent


def export(family: str, arch: str, out: pathlib.Path) -> pathlib.Path:
  target = out / f"{family}_{arch}"
  if target.exists():
    shutil.rmtree(target)
  target.mkdir(parents=True)
  env = dict(os.environ, CUTE_DSL_ARCH=arch)
  start = time.perf_counter()
  subprocess.run(
      [sys.executable, str(SOURCE_DIR / family / "export.py"), "--arch", arch, "--out", str(target)],
      check=True, env=env)
  objects = sorted(target.glob("*.o"))
  if not objects:
    raise SystemExit(f"jax_flash: {family} export for {arch} produced no object files")
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
