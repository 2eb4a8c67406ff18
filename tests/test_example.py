"""A short run of examples/train_gpt.py with both attention functions."""

import importlib.util
import json
import pathlib

import numpy as np

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
TINY = ["--steps", "20", "--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "32",
        "--batch", "8", "--learning-rate", "1e-2", "--no-progress"]
# Same data and initialisation: the curves differ only by the attention's
# float32 rounding, which a few optimizer steps amplify a little.
LOSS_TOLERANCE = 1e-3


def load_example():
  spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_train_gpt_jax_flash_matches_jax_nn(tmp_path):
  example = load_example()
  records = {name: example.main(["--attention", name, "--out", str(tmp_path), *TINY])
             for name in example.ATTENTIONS}
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
