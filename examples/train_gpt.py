"""Trains a small GPT-style decoder with jax_flash attention (Flax linen + optax).

The corpus is generated here, deterministically, so the example needs no
download: lines of decimal additions (``37+58=95``), whose answers a model
can only predict by attending back to the operands, mixed with sentences from
a tiny grammar. The model is a pre-LayerNorm decoder whose attention is the
stock ``flax.linen.MultiHeadDotProductAttention``; ``--attention`` picks its
``attention_fn``:

  jax_flash  jax_flash.nn.make_flax_attention_fn(is_causal=True)
  jax_nn     jax.nn.dot_product_attention(..., is_causal=True)

Both runs see the same initial parameters and batches, so their loss curves
should agree up to floating-point noise. Each run writes
``OUT/losses_<attention>.json``; ``OUT/loss.png`` plots every run found in
``OUT`` (and their difference when there are two)::

  python examples/train_gpt.py --attention jax_flash --steps 200
  python examples/train_gpt.py --attention jax_nn --steps 200
  python examples/train_gpt.py --cpu-sizes --steps 200    # a few minutes on a CPU

The default sizes are a GPU's: bfloat16 compute and head dim 64 at 1024
tokens, which jax_flash's GPU kernels serve (float32 or head dims they lack
would fall back to XLA). ``--cpu-sizes`` trains a smaller float32 model.
The run prints at its start which attention serves it on this device.
"""

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
import tqdm

import jax_flash.nn

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

ATTENTIONS = ("jax_flash", "jax_nn")
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results"

_NOUNS = ("fox", "bird", "cat", "river", "tree", "robot", "lamp", "horse")
_ADJECTIVES = ("red", "small", "quick", "quiet", "old", "bright")
_VERBS = ("sees", "follows", "finds", "likes", "paints", "hears")


def make_corpus(num_lines: int, seed: int) -> str:
  """Deterministic synthetic text: additions and grammar sentences."""
  rng = np.random.default_rng(seed)
  lines = []
  for _ in range(num_lines):
    if rng.random() < 0.5:
      a, b = rng.integers(0, 100, size=2)
      lines.append(f"{a}+{b}={a + b}")
    else:
      words = ["the", rng.choice(_ADJECTIVES), rng.choice(_NOUNS), rng.choice(_VERBS), "a",
               rng.choice(_ADJECTIVES), rng.choice(_NOUNS)]
      lines.append(" ".join(words) + ".")
  return "\n".join(lines) + "\n"


@dataclasses.dataclass(frozen=True)
class Config:
  """Model and training hyperparameters; the defaults are sized for a GPU."""

  layers: int = 4
  width: int = 512
  heads: int = 8
  seq_len: int = 1024
  batch: int = 16
  dtype: str = "bfloat16"  # compute dtype; parameters and the loss stay float32
  learning_rate: float = 1e-3
  seed: int = 0

  @property
  def head_dim(self) -> int:
    return self.width // self.heads


# The model before the GPU defaults: 200 steps take about 40 s on two CPU cores.
DTYPES = ("bfloat16", "float16", "float32")
CPU_SIZES = dict(layers=2, width=128, heads=4, seq_len=128, batch=16, dtype="float32",
                 learning_rate=3e-3)
HELP = {
    "layers": "transformer blocks", "width": "model width (head dim = width / heads)",
    "heads": "attention heads", "seq_len": "tokens per sequence", "batch": "sequences per step",
    "dtype": "compute dtype of the layers",
    "learning_rate": "peak AdamW learning rate (warmup, then cosine decay)",
    "seed": "seed of the corpus, the initialisation and the batches",
}


def jax_nn_causal_attention(query, key, value):
  """The baseline ``attention_fn``: ``jax.nn``'s causal attention."""
  return jax.nn.dot_product_attention(query, key, value, is_causal=True)


def attention_path(name: str, config: Config) -> str:
  """Which attention serves this model on this device: jax_flash's kernels,
  or XLA (jax.nn, or jax_flash falling back where its kernels do not cover
  the dtype or head dim). Decided by tracing one call of the model's shape."""
  platform = jax.default_backend()
  if name == "jax_nn":
    return f"XLA (jax.nn.dot_product_attention on {platform})"
  q = jax.ShapeDtypeStruct((1, config.seq_len, config.heads, config.head_dim), config.dtype)
  try:
    jax.eval_shape(lambda q: jax_flash.attention(q, q, q, causal=True, implementation="flash"), q)
  except NotImplementedError as e:
    return f"XLA: jax_flash falls back, its kernels do not serve this call ({e})"
  return f"jax_flash {platform.upper()} kernels ({config.dtype}, head dim {config.head_dim})"


def attention_fn(name: str):
  if name == "jax_flash":
    return jax_flash.nn.make_flax_attention_fn(is_causal=True)
  if name == "jax_nn":
    return jax_nn_causal_attention
  raise ValueError(f"attention must be one of {ATTENTIONS}, got {name!r}")


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

  heads: int
  attention_fn: object
  dtype: str

  @nn.compact
  def __call__(self, x):
    width = x.shape[-1]
    h = nn.LayerNorm(dtype=self.dtype)(x)
    x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype,
                                            attention_fn=self.attention_fn)(h)
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(4 * width, dtype=self.dtype)(h)
    return x + nn.Dense(width, dtype=self.dtype)(nn.gelu(h))


class GPT(nn.Module):
  """Token and learned position embeddings, ``layers`` blocks, a linear head."""

  vocab: int
  config: Config
  attention_fn: object

  @nn.compact
  def __call__(self, tokens):
    positions = jnp.arange(tokens.shape[-1])
    dtype = self.config.dtype
    x = nn.Embed(self.vocab, self.config.width, dtype=dtype)(tokens)
    x = x + nn.Embed(self.config.seq_len, self.config.width, dtype=dtype)(positions)
    for _ in range(self.config.layers):
      x = Block(self.config.heads, self.attention_fn, dtype)(x)
    # The logits in float32: a bfloat16 softmax cross-entropy would round the loss.
    return nn.Dense(self.vocab)(nn.LayerNorm()(x).astype(jnp.float32))


def batches(data: np.ndarray, config: Config, steps: int):
  """``steps`` batches of ``seq_len + 1`` tokens at seeded random offsets."""
  rng = np.random.default_rng(config.seed + 1)
  starts = rng.integers(0, len(data) - config.seq_len - 1, size=(steps, config.batch))
  window = np.arange(config.seq_len + 1)
  for row in starts:
    yield data[row[:, None] + window]


def train(attention: str, steps: int, config: Config, show_progress: bool = True) -> list[float]:
  """Trains from a fixed initialisation; returns the loss of every step."""
  text = make_corpus(num_lines=20_000, seed=config.seed)
  codes = np.frombuffer(text.encode("ascii"), np.uint8)
  vocab = np.unique(codes)
  data = np.searchsorted(vocab, codes).astype(np.int32)
  model = GPT(len(vocab), config, attention_fn(attention))
  params = model.init(jax.random.key(config.seed), data[None, :config.seq_len])
  schedule = optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, steps // 10 + 1,
                                                max(steps, 2))
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    def loss_fn(params):
      logits = model.apply(params, batch[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  progress = tqdm.tqdm(batches(data, config, steps), total=steps, desc=attention,
                       disable=not show_progress)
  for i, batch in enumerate(progress):
    params, opt_state, loss = step(params, opt_state, jnp.asarray(batch))
    losses.append(loss)
    if i % 10 == 0 or i == steps - 1:
      progress.set_postfix(loss=f"{float(loss):.3f}")
  return [float(x) for x in losses]


def plot(out: pathlib.Path) -> pathlib.Path:
  """Draws every ``losses_*.json`` in ``out`` into ``out/loss.png``."""
  runs = {}
  for path in sorted(out.glob("losses_*.json")):
    record = json.loads(path.read_text())
    runs[record["attention"]] = np.array(record["losses"])
  both = all(name in runs for name in ATTENTIONS)
  figure, axes = plt.subplots(1, 2 if both else 1, figsize=(11 if both else 6, 4),
                              squeeze=False)
  for name, losses in runs.items():
    axes[0, 0].plot(losses, label=name, linestyle="-" if name == "jax_flash" else "--")
  axes[0, 0].set(xlabel="step", ylabel="cross-entropy (nats/char)", title="training loss")
  axes[0, 0].legend()
  if both:
    steps = min(len(runs[name]) for name in ATTENTIONS)
    difference = np.abs(runs["jax_flash"][:steps] - runs["jax_nn"][:steps])
    floor = 1e-9  # a log axis cannot show the steps where the losses are equal
    axes[0, 1].semilogy(np.maximum(difference, floor), marker=".", linestyle="none")
    axes[0, 1].set(xlabel="step", ylabel=f"|loss difference| (0 drawn at {floor:g})",
                   title=f"jax_flash vs jax.nn: max {difference.max():.2g}")
  figure.tight_layout()
  path = out / "loss.png"
  figure.savefig(path, dpi=100)
  plt.close(figure)
  return path


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n")[0],
      epilog="Sizes default to a GPU's (bfloat16, head dim 64, 1024 tokens); --cpu-sizes picks "
             "a small float32 model; a flag given explicitly wins over both.")
  parser.add_argument("--attention", choices=ATTENTIONS, default="jax_flash",
                      help="attention_fn of the model's attention layers")
  parser.add_argument("--steps", type=int, default=200, help="training steps")
  parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                      help="folder for losses_<attention>.json and loss.png")
  parser.add_argument("--cpu-sizes", action="store_true",
                      help="a model a CPU trains in minutes: " + ", ".join(
                          f"{name.replace('_', '-')} {value}" for name, value in CPU_SIZES.items()))
  for field in dataclasses.fields(Config):
    choices = DTYPES if field.name == "dtype" else None
    parser.add_argument(f"--{field.name.replace('_', '-')}", type=str if choices else field.type,
                        choices=choices, default=None,
                        help=f"{HELP[field.name]} (default {getattr(Config(), field.name)})")
  parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
  return parser.parse_args(argv)


def config_from(args) -> Config:
  """Explicit flags over the preset (``--cpu-sizes``) over the GPU defaults."""
  config = Config(**CPU_SIZES) if args.cpu_sizes else Config()
  given = {field.name: getattr(args, field.name) for field in dataclasses.fields(Config)
           if getattr(args, field.name) is not None}
  return dataclasses.replace(config, **given)


def main(argv=None) -> dict:
  """Runs the example; returns the record it wrote."""
  args = parse_args(argv)
  config = config_from(args)
  path_used = attention_path(args.attention, config)
  print(f"{args.attention}: attention served by {path_used}", flush=True)
  start = time.perf_counter()
  losses = train(args.attention, args.steps, config, show_progress=not args.no_progress)
  record = dict(attention=args.attention, steps=args.steps, config=dataclasses.asdict(config),
                backend=jax.default_backend(), device=jax.devices()[0].device_kind,
                attention_path=path_used, seconds=round(time.perf_counter() - start, 2),
                losses=losses)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / f"losses_{args.attention}.json").write_text(json.dumps(record, indent=1) + "\n")
  path = plot(args.out)
  print(f"{args.attention}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {record['seconds']} s; "
        f"plot: {path}")
  return record


if __name__ == "__main__":
  main(sys.argv[1:])
