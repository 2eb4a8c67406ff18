"""Checks on the machine code of exported kernels, for properties that no
test can see because they only cost time.

The one check so far guards the Hopper forward's intra-warpgroup overlap:
ptxas schedules the wait for the PV GEMM (`WARPGROUP.DEPBAR.LE gsb0, 0x0`)
as early as its dependencies allow, and unless the kernel anchors it (see
`_consume` in fwd_sm90/kernel.py) it lands above the softmax, which then no
longer overlaps that GEMM, a few percent of the forward
(docs/kernel-evidence.md).

It needs `cuobjdump` and the `nvdisasm` it calls: named by $CUOBJDUMP, on
PATH (CUDA toolkit) or from the pip packages nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm, which the build requires (pyproject.toml), so that
every build with the GPU kernels runs the checks. export_kernels.py prints
that it skipped them when there is none.

    python -m cuda_src.sass_checks BUILD/aot/fwd_sm90_sm_90a
"""

import importlib.util
import os
import pathlib
import re
import shutil
import struct
import subprocess
import sys
import tempfile

ELF_MAGIC = b"\x7fELF"
EM_CUDA = 190
WAIT_FOR_S = "WARPGROUP.DEPBAR.LE gsb0, 0x1"
WAIT_FOR_PV = "WARPGROUP.DEPBAR.LE gsb0, 0x0"


def embedded_cubins(data: bytes) -> list:
  """The CUDA ELF images inside an export_to_c object file (which is itself
  an ELF: only images whose e_machine is EM_CUDA count)."""
  cubins, start = [], 0
  while (start := data.find(ELF_MAGIC, start + 1)) > 0:
    if len(data) < start + 64 or struct.unpack_from("<H", data, start + 18)[0] != EM_CUDA:
      continue
    phoff, shoff = struct.unpack_from("<QQ", data, start + 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, start + 54)
    cubins.append(data[start:start + max(phoff + phentsize * phnum, shoff + shentsize * shnum)])
  return cubins


def exps_after_pv_wait(sass: str):
  """(exp2s before, exp2s after) the wait for the PV GEMM in the forward's
  main loop: the MUFU.EX2 between the loop's wait for S and the next full
  wait, and those between that wait and the next HGMMA (the last tile's PV
  GEMM after the loop). None when the code has no such loop."""
  lines = [line for line in sass.splitlines() if "/*" in line]
  s_wait = next((i for i, line in enumerate(lines) if WAIT_FOR_S in line), None)
  if s_wait is None:
    return None
  pv_wait = next((i for i in range(s_wait, len(lines)) if WAIT_FOR_PV in lines[i]), None)
  if pv_wait is None:
    return None
  end = next((i for i in range(pv_wait, len(lines)) if "HGMMA" in lines[i]), len(lines))
  count = lambda a, b: sum("MUFU.EX2" in line for line in lines[a:b])
  return count(s_wait, pv_wait), count(pv_wait, end)


def _pip_cuda_tool(name: str):
  """NAME from an installed nvidia-cuda-* package (nvidia/cu*/bin), if any."""
  spec = importlib.util.find_spec("nvidia")
  for root in (spec.submodule_search_locations or []) if spec else []:
    for tool in sorted(pathlib.Path(root).glob(f"cu*/bin/{name}"), reverse=True):
      if os.access(tool, os.X_OK):
        return str(tool)
  return None


def find_cuobjdump():
  return os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or _pip_cuda_tool("cuobjdump")


def disassemble(cubin: bytes, cuobjdump: str) -> str:
  env = dict(os.environ)
  nvdisasm = shutil.which("nvdisasm") or _pip_cuda_tool("nvdisasm")
  if nvdisasm:  # cuobjdump -sass runs it from PATH
    env["PATH"] = os.pathsep.join([str(pathlib.Path(nvdisasm).parent), env.get("PATH", "")])
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin)
    f.flush()
    return subprocess.run([cuobjdump, "-sass", f.name], check=True, capture_output=True,
                          text=True, env=env).stdout


def check_pv_wait(objects, cuobjdump: str) -> list:
  """Problems found in the forward objects: a kernel whose softmax exp2s
  sit after the wait for the PV GEMM, or that has no such loop."""
  problems = []
  for path in objects:
    for cubin in embedded_cubins(pathlib.Path(path).read_bytes()):
      counts = exps_after_pv_wait(disassemble(cubin, cuobjdump))
      if counts is None:
        problems.append(f"{pathlib.Path(path).stem}: no KV loop with a wait for S and for PV found")
      elif counts[1] or not counts[0]:
        problems.append(f"{pathlib.Path(path).stem}: {counts[1]} of {sum(counts)} softmax exp2s run "
                        "after the wait for the PV GEMM (the softmax no longer overlaps it)")
  return problems


# Kernel family -> check over its object files.
CHECKS = {"fwd_sm90": check_pv_wait}

# Problems seen and not yet fixed, by kernel: reported, not fatal. None now:
# the fp16 forwards' exp2s sat after the wait until online_softmax pinned them
# with a side-effecting ex2 (37 of 172 at hd128 before).
KNOWN_PROBLEMS: dict = {}


def run(family: str, objects) -> list:
  """The family's problems, less KNOWN_PROBLEMS (printed), or None when
  there is no check for it or no cuobjdump."""
  cuobjdump = find_cuobjdump()
  if family not in CHECKS or cuobjdump is None:
    return None
  problems = []
  for problem in CHECKS[family](objects, cuobjdump):
    kernel = problem.split(":")[0]
    if kernel in KNOWN_PROBLEMS:
      print(f"jax_flash: known: {kernel}: {KNOWN_PROBLEMS[kernel]}")
    else:
      problems.append(problem)
  return problems


if __name__ == "__main__":
  folder = pathlib.Path(sys.argv[1])
  found = run(folder.name.rsplit("_sm_", 1)[0], sorted(folder.glob("*.o")))
  print("no check or no cuobjdump" if found is None else "\n".join(found) or "ok")
  sys.exit(1 if found else 0)
