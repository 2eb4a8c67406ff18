"""The model that examples/generate.py serves: a small Llama-style decoder.

GQA attention with rotary positions, RMSNorm, a SwiGLU MLP, bfloat16 weights,
ASCII bytes as tokens. Every function here works on a flat batch of tokens
``[tokens, width]`` and treats each token on its own (the norms reduce over
a token's features only), so a token's result depends on the other tokens of
the batch only through the matrix products' shapes and through attention.

Tensor parallel (Megatron-style): each device holds a slice of the heads and
of the MLP's hidden units; the attention output and MLP projections end in a
sum over devices (``reduce``). ``param_specs`` says which axis of each weight
is split over the mesh axis ``TP``.

Sampling (``sample``) draws each row with its request's own key, so a
request's tokens do not depend on its row either.

The weights are trained briefly here, on text generated here (``corpus``):
no download.
"""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jax_flash

VOCAB = 128  # ASCII bytes
TP = "tp"  # the mesh axis the heads and the MLP are split over


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Model sizes; the defaults are the GPU model (see generate.py: why this size)."""

  layers: int = 8
  width: int = 2048
  heads: int = 16
  kv_heads: int = 4
  head_dim: int = 128
  mlp: int = 5632
  dtype: str = "bfloat16"
  rope_base: float = 10000.0
  norm_eps: float = 1e-5

  def parameter_count(self) -> int:
    attention = self.width * (self.heads + 2 * self.kv_heads) * self.head_dim
    attention += self.heads * self.head_dim * self.width
    per_layer = attention + 3 * self.width * self.mlp + 2 * self.width
    return self.layers * per_layer + 2 * VOCAB * self.width + self.width

  def kv_bytes_per_token(self) -> int:
    return self.layers * 2 * self.kv_heads * self.head_dim * jnp.dtype(self.dtype).itemsize

  def describe(self) -> dict:
    return dataclasses.asdict(self) | {"parameters": self.parameter_count(),
                                       "kv_bytes_per_token": self.kv_bytes_per_token()}


# A model a CPU trains in seconds; 8 kv heads so that 8 devices each get one.
CPU_MODEL = dict(layers=2, width=256, heads=16, kv_heads=8, head_dim=16, mlp=512)

_LAYER_SPECS = {"attn_norm": P(), "wq": P(None, TP), "wk": P(None, TP), "wv": P(None, TP),
                "wo": P(TP, None), "mlp_norm": P(), "w_gate": P(None, TP), "w_up": P(None, TP),
                "w_down": P(TP, None)}


def param_specs(config: ModelConfig) -> dict:
  """How each weight is split over the mesh axis TP: q / k / v columns and
  the MLP's hidden units (column-parallel), wo / w_down rows (row-parallel).
  Contiguous column blocks keep each device's query heads whole GQA groups
  of its kv heads."""
  return {"embed": P(), "final_norm": P(), "lm_head": P(),
          "layers": [dict(_LAYER_SPECS) for _ in range(config.layers)]}


def init_params(config: ModelConfig, seed: int, dtype=jnp.float32) -> dict:
  keys = iter(jax.random.split(jax.random.key(seed), 2 + 7 * config.layers))
  dense = lambda fan_in, fan_out: (jax.random.normal(next(keys), (fan_in, fan_out), dtype)
                                   * fan_in ** -0.5)
  q_width, kv_width = config.heads * config.head_dim, config.kv_heads * config.head_dim
  layers = [{"attn_norm": jnp.ones(config.width, dtype),
             "wq": dense(config.width, q_width), "wk": dense(config.width, kv_width),
             "wv": dense(config.width, kv_width), "wo": dense(q_width, config.width),
             "mlp_norm": jnp.ones(config.width, dtype),
             "w_gate": dense(config.width, config.mlp), "w_up": dense(config.width, config.mlp),
             "w_down": dense(config.mlp, config.width)} for _ in range(config.layers)]
  return {"embed": jax.random.normal(next(keys), (VOCAB, config.width), dtype),
          "layers": layers, "final_norm": jnp.ones(config.width, dtype),
          "lm_head": dense(config.width, VOCAB)}


def rms_norm(x, weight, eps):
  """Per token, in float32."""
  x32 = x.astype(jnp.float32)
  scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * scale * weight.astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, base):
  """Rotary positions (the rotate-half convention): x ``[tokens, heads,
  head_dim]``, positions ``[tokens]``."""
  half = x.shape[-1] // 2
  inverse_frequency = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions.astype(jnp.float32)[:, None, None] * inverse_frequency
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def forward(params, tokens, positions, config: ModelConfig, attend, caches, reduce=lambda x: x):
  """The decoder over a flat batch ``tokens [n]`` at ``positions [n]``.

  ``attend(layer, q, k, v, cache) -> (out, cache)`` is the attention of
  layer ``layer`` (q ``[n, heads, head_dim]``, k / v ``[n, kv_heads,
  head_dim]``, the heads this device holds); ``caches`` its per-layer
  state (a KV cache, or None for training). ``reduce`` sums the row-parallel
  products over the devices (``jax.lax.psum`` under tensor parallelism).
  Returns ``(hidden states after the final norm [n, width], caches)``."""
  eps = config.norm_eps
  x = params["embed"][tokens]
  new_caches = []
  for index, (layer, cache) in enumerate(zip(params["layers"], caches)):
    h = rms_norm(x, layer["attn_norm"], eps)
    q = (h @ layer["wq"]).reshape(len(tokens), -1, config.head_dim)
    k = (h @ layer["wk"]).reshape(len(tokens), -1, config.head_dim)
    v = (h @ layer["wv"]).reshape(len(tokens), -1, config.head_dim)
    q, k = rope(q, positions, config.rope_base), rope(k, positions, config.rope_base)
    out, cache = attend(index, q, k, v, cache)
    x = x + reduce(out.reshape(len(tokens), -1) @ layer["wo"])
    h = rms_norm(x, layer["mlp_norm"], eps)
    gated = jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])
    x = x + reduce(gated @ layer["w_down"])
    new_caches.append(cache)
  return rms_norm(x, params["final_norm"], eps), new_caches


def logits_of(params, hidden):
  """The head in float32 (sampling and the fingerprints read these bits)."""
  return jnp.dot(hidden, params["lm_head"], preferred_element_type=jnp.float32)


def sample(logits, temperature, seeds, positions):
  """Per row: argmax at temperature 0, else a draw with the row's own key,
  ``fold_in(key(seed), position)``: a row's token never depends on the others."""
  def draw(logits, temperature, seed, position):
    key = jax.random.fold_in(jax.random.key(seed), position)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)
    drawn = jnp.argmax(scaled + jax.random.gumbel(key, logits.shape, jnp.float32))
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits)).astype(jnp.int32)
  return jax.vmap(draw)(logits, temperature, seeds, positions)


def fingerprint(logits):
  """A uint32 of each row's float32 bits (integer sums: exact in any order)."""
  bits = jax.lax.bitcast_convert_type(logits, jnp.uint32)
  weights = jnp.arange(logits.shape[-1], dtype=jnp.uint32) * jnp.uint32(2654435761) | 1
  return jnp.sum(bits * weights, axis=-1, dtype=jnp.uint32)


def sequence_logits(params, tokens, config: ModelConfig, attention=None):
  """Logits ``[batch, seq, VOCAB]`` of whole sequences ``tokens [batch,
  seq]`` without a cache: training, and the reference the tests compare the
  served tokens with. ``attention(q, k, v)`` on ``[batch, seq, heads,
  head_dim]`` is causal self-attention (jax_flash's by default)."""
  attention = attention or (lambda q, k, v: jax_flash.attention(q, k, v, causal=True))
  batch, seq = tokens.shape

  def attend(_, q, k, v, cache):
    split = lambda x: x.reshape(batch, seq, *x.shape[1:])
    return attention(split(q), split(k), split(v)).reshape(q.shape), cache

  positions = jnp.tile(jnp.arange(seq), batch)
  hidden, _ = forward(params, tokens.reshape(-1), positions, config, attend,
                      [None] * config.layers)
  return logits_of(params, hidden).reshape(batch, seq, VOCAB)


# The corpus: short tasks whose answers follow from the line itself.
_WORDS = ("jax", "flash", "page", "cache", "token", "kernel", "batch", "query", "tile", "head")


def corpus_line(rng: np.random.Generator) -> str:
  kind = rng.integers(3)
  if kind == 0:
    a, b = rng.integers(0, 1000, size=2)
    return f"add {a} {b} = {a + b}"
  if kind == 1:
    numbers = rng.integers(0, 100, size=rng.integers(2, 7))
    return f"sort {' '.join(map(str, numbers))} = {' '.join(map(str, np.sort(numbers)))}"
  words = " ".join(rng.choice(_WORDS, size=rng.integers(1, 4)))
  return f"reverse {words} = {words[::-1]}"


def corpus(num_lines: int, seed: int) -> str:
  rng = np.random.default_rng(seed)
  return "\n".join(corpus_line(rng) for _ in range(num_lines)) + "\n"


def encode(text: str) -> np.ndarray:
  return np.frombuffer(text.encode("ascii"), np.uint8).astype(np.int32)


def decode(tokens) -> str:
  return bytes(int(t) for t in tokens).decode("ascii", errors="replace")


def train(config: ModelConfig, steps: int, seed: int = 0, batch: int = 16, seq: int = 256,
          compute_dtype=None, log=print) -> dict:
  """A brief AdamW run on the generated corpus; returns float32 weights."""
  compute_dtype = compute_dtype or config.dtype
  data = encode(corpus(num_lines=max(4 * steps * batch * seq // 20, 2000), seed=seed))
  params = init_params(config, seed)
  if steps == 0:
    return params
  schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(steps // 10, 1), steps, 3e-4)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule))
  state = optimizer.init(params)

  @jax.jit
  def step(params, state, windows):
    def loss_fn(params):
      low = jax.tree.map(lambda w: w.astype(compute_dtype), params)
      logits = sequence_logits(low, windows[:, :-1], config)
      return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  rng = np.random.default_rng(seed + 1)
  for i in range(steps):
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    params, state, loss = step(params, state, data[starts[:, None] + np.arange(seq + 1)])
    if i == 0 or i == steps - 1 or (i + 1) % max(steps // 4, 1) == 0:
      log(f"train step {i + 1}/{steps}: loss {float(loss):.3f}")
  return params


def _leaf_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def save_params(path: pathlib.Path, params: dict, config: ModelConfig) -> None:
  flat = {_leaf_name(keys): np.asarray(w)
          for keys, w in jax.tree_util.tree_flatten_with_path(params)[0]}
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "wb") as f:
    np.savez(f, config=json.dumps(dataclasses.asdict(config)), **flat)


def load_params(path: pathlib.Path, config: ModelConfig) -> dict:
  """Weights ``save_params`` wrote for this same config."""
  with np.load(path) as saved:
    if json.loads(str(saved["config"])) != dataclasses.asdict(config):
      raise ValueError(f"{path} holds weights of {str(saved['config'])}, not of {config}")
    template = jax.eval_shape(lambda: init_params(config, seed=0))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(saved[_leaf_name(keys)]) for keys, _ in leaves])
