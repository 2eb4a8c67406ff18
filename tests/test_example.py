"""A short run of examples/train_gpt.py with both attention functions."""

import importlib.util
import json
import pathlib

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
TINY = ["--cpu-sizes", "--steps", "20", "--layers", "1", "--width", "32", "--heads", "2",
        "--seq-len", "32", "--batch", "8", "--learning-rate", "1e-2", "--no-progress"]
# Same data and initialisation: the curves differ only by the attention's
# float32 rounding, which a few optimizer steps amplify a little.
LOSS_TOLERANCE = 1e-3


def load_example():
  spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # two short training runs: about 8 s on a 2-core machine
def test_train_gpt_jax_flash_matches_jax_nn(tmp_path, capsys):
  example = load_example()
  records = {name: example.main(["--attention", name, "--out", str(tmp_path), *TINY])
             for name in example.ATTENTIONS}
  printed = capsys.readouterr().out
  assert "jax_flash: attention served by jax_flash CPU kernels (float32, head dim 16)" in printed
  assert "jax_nn: attention served by XLA (jax.nn.dot_product_attention on cpu)" in printed
  assert records["jax_flash"]["config"]["dtype"] == "float32"
  flash = np.array(records["jax_flash"]["losses"])
  baseline = np.array(records["jax_nn"]["losses"])
  assert flash.shape == baseline.shape == (20,)
  assert np.all(np.isfinite(flash))
  np.testing.assert_allclose(flash, baseline, atol=LOSS_TOLERANCE, rtol=0)
  assert flash[-5:].mean() < 0.8 * flash[:5].mean(), flash
  # What the run leaves behind: one JSON per attention and the shared plot.
  for name in example.ATTENTIONS:
    saved = json.loads((tmp_path / f"losses_{name}.json").read_text())
    assert saved["losses"] == records[name]["losses"]
  assert (tmp_path / "loss.png").stat().st_size > 0


def test_sizes_default_to_a_gpu_and_flags_win_over_the_cpu_preset():
  example = load_example()
  gpu = example.config_from(example.parse_args([]))
  assert (gpu.dtype, gpu.head_dim, gpu.seq_len) == ("bfloat16", 64, 1024)
  cpu = example.config_from(example.parse_args(["--cpu-sizes", "--width", "64"]))
  assert (cpu.dtype, cpu.width, cpu.heads, cpu.seq_len) == ("float32", 64, 4, 128)


def test_attention_path_names_the_fallback():
  example = load_example()
  config = example.Config(width=2048, heads=2, seq_len=16, dtype="float32")  # head dim 1024
  assert example.attention_path("jax_flash", config).startswith("XLA: jax_flash falls back")
  assert "kernels (bfloat16, head dim 64)" in example.attention_path("jax_flash", example.Config())
