"""The README's python code blocks run as written.

The blocks are read from README.md when the test runs (the README changes
under it) and executed in order in one fresh Python process, sharing one
namespace as a reader pasting them one after another would, from the
repository root, with this suite's environment (XLA_FLAGS gives the CPU 8
devices, as conftest.py sets it). A failure names the block by its first
line in README.md.

Skip rule: a block that names the GPU kernels explicitly -- it contains
``implementation="gpu"``, ``jax.devices("gpu")`` or ``cuda_handler_calls`` --
runs only where they can run (a CUDA GPU visible and the kernels built);
elsewhere it is left out, and so are the blocks after it, which may build on
it. Every other block runs on any machine.

The notebooks run top to bottom in tests/test_notebooks.py.
"""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from jax_flash import _api as api

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GPU_MARKERS = ('implementation="gpu"', "implementation='gpu'", 'jax.devices("gpu")',
               "jax.devices('gpu')", "cuda_handler_calls")
TIMEOUT_S = 900

# Executes the blocks (a JSON list of [first line, source]) in one namespace;
# prints which block failed before re-raising.
RUNNER = textwrap.dedent("""
    import json, sys, traceback
    namespace = {"__name__": "__main__"}
    for line, source in json.load(sys.stdin):
      try:
        exec(compile(source, f"README.md:{line}", "exec"), namespace)
      except BaseException:
        traceback.print_exc()
        print(f"README.md block at line {line} failed", file=sys.stderr)
        sys.exit(1)
""")


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(line of the block's first code line, source) of each ```python block."""
  blocks = []
  for match in re.finditer(r"^```python[ \t]*\n(.*?)^```", text, re.M | re.S):
    blocks.append((text[:match.start()].count("\n") + 2, match.group(1)))
  return blocks


def runnable(blocks, gpu_usable: bool):
  """The blocks to run under the skip rule of the module docstring."""
  if gpu_usable:
    return blocks
  for i, (_, source) in enumerate(blocks):
    if any(marker in source for marker in GPU_MARKERS):
      return blocks[:i]
  return blocks


def test_python_blocks_are_found():
  text = "intro\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = x\n```\n"
  assert python_blocks(text) == [(3, "x = 1\n"), (9, "y = x\n")]
  gpu_block = (20, 'attention(q, k, v, implementation="gpu")\n')
  assert runnable([(1, "a"), gpu_block, (30, "b")], gpu_usable=False) == [(1, "a")]
  assert len(runnable([(1, "a"), gpu_block, (30, "b")], gpu_usable=True)) == 3


def test_readme_python_blocks_run():
  blocks = python_blocks(README.read_text())
  assert blocks, "README.md holds no python code block"
  gpu_usable = api._gpu_unavailable_reason() is None
  chosen = runnable(blocks, gpu_usable)
  if not chosen:
    pytest.skip("every python block of README.md needs the GPU kernels")
  result = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(chosen), cwd=ROOT,
                          env=dict(os.environ), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
  assert result.returncode == 0, result.stderr[-6000:]
