"""Runs the notebooks top to bottom, from the repository root, as a reader would."""

import json
import pathlib

import pytest

# The test extras hold these; a GPU machine with only the run-time packages
# (scripts/gpu_check.sh installs without dependencies) skips the notebooks.
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CELL_TIMEOUT_S = 240


def execute(name: str) -> nbformat.NotebookNode:
  """Executes a copy of ``notebooks/<name>.ipynb``; returns it with outputs."""
  notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                   resources={"metadata": {"path": str(ROOT)}})
  client.execute()
  return notebook


def printed(notebook) -> str:
  return "".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                 for output in cell.get("outputs", []))


EXECUTED = ("quickstart", "benchmarks")  # by the tests below


def test_every_notebook_is_executed():
  assert sorted(path.stem for path in NOTEBOOKS.glob("*.ipynb")) == sorted(EXECUTED)


@pytest.mark.parametrize("name", EXECUTED)
def test_committed_without_outputs(name):
  notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  nbformat.validate(notebook)
  for cell in notebook.cells:
    if cell.cell_type == "code":
      assert not cell.outputs and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow
def test_quickstart(monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  text = printed(execute("quickstart"))
  assert "8 devices" in text
  assert "output sharding: P('batch', None, 'heads', None)" in text
  assert "max |sharded - single device| = 0.0" in text


@pytest.mark.slow
def test_benchmarks_without_results(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_FLASH_BENCHMARK_RESULTS", str(tmp_path / "missing"))
  text = printed(execute("benchmarks"))
  assert "no benchmark results" in text
  assert "nothing to plot yet" in text


def row(impl, seq, tflops, head_dim=128, causal=False, op="fwd"):
  return {"impl": impl, "op": op, "dtype": "bfloat16", "batch": 2, "seq_q": seq, "seq_k": seq,
          "heads_q": 16, "heads_kv": 16, "head_dim": head_dim, "head_dim_v": head_dim,
          "causal": causal, "window": None, "variant": "", "tflops": tflops, "ms": 1.0,
          "gbps": None, "gpu": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "date": "2026-11-30",
          "matmul_ceiling_tflops": 700.0}


@pytest.mark.slow
def test_benchmarks_with_partial_results(tmp_path, monkeypatch):
  rows = [row(impl, seq, tflops, causal=causal)
          for impl, tflops in (("jax_flash", 500.0), ("cudnn", 600.0))
          for seq in (2048, 8192) for causal in (False, True)]
  rows.append(row("jax_flash", 8192, 300.0, head_dim=64))  # no cuDNN row to compare with
  (tmp_path / "h100-2026-11-30.json").write_text(json.dumps(rows))
  (tmp_path / "broken.json").write_text("{")
  monkeypatch.setenv("JAX_FLASH_BENCHMARK_RESULTS", str(tmp_path))
  notebook = execute("benchmarks")
  text = printed(notebook)
  assert "9 rows from 1 file(s)" in text
  assert "skipping broken.json" in text
  assert " 0.83" in text  # 500 / 600
  images = [output for cell in notebook.cells for output in cell.get("outputs", [])
            if "image/png" in output.get("data", {})]
  assert len(images) == 2
