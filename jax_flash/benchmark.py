"""Timing attention implementations side by side, in one process.

Used by ``python -m jax_flash`` and ``benchmarks/bench_attention.py``. Rows
follow DESIGN.md §8: forward TFLOPS count ``4 * B * N * T * S * D`` (halved
for causal when T == S); the backward counts 2.5x that and is timed as
(forward + backward) - forward.
"""

import dataclasses
import datetime
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

IMPLEMENTATIONS = ("jax_flash", "cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class Config:
  batch: int
  seq: int
  heads: int
  head_dim: int
  causal: bool
  dtype: str = "bfloat16"
  heads_kv: int | None = None

  def forward_flops(self) -> float:
    flops = 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim
    return flops / 2 if self.causal else flops


def attention_fn(impl: str, causal: bool):
  """A function (q, k, v) -> out for one implementation name."""
  if impl == "jax_flash":
    return lambda q, k, v: jax_flash.attention(q, k, v, causal=causal, implementation="flash")
  if impl in ("cudnn", "xla"):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation=impl)
  raise ValueError(f"unknown implementation {impl!r}")


def _time(fn, args, iters: int, reps: int = 5) -> float:
  """Median milliseconds per call over `reps` loops of `iters` calls."""
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) * 1e3 / iters)
  return statistics.median(samples)


def inputs(config: Config, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 4)
  heads_kv = config.heads_kv or config.heads
  shape_q = (config.batch, config.seq, config.heads, config.head_dim)
  shape_kv = (config.batch, config.seq, heads_kv, config.head_dim)
  dtype = jnp.dtype(config.dtype)
  make = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return (make(keys[0], shape_q), make(keys[1], shape_kv), make(keys[2], shape_kv),
          make(keys[3], shape_q))


def measure(impl: str, config: Config, iters: int = 10, backward: bool = True) -> dict:
  """Forward (and backward) milliseconds and TFLOPS of one implementation."""
  q, k, v, dout = inputs(config)
  attend = attention_fn(impl, config.causal)
  forward = jax.jit(attend)

  @jax.jit
  def forward_backward(q, k, v, dout):
    out, pullback = jax.vjp(attend, q, k, v)
    return pullback(dout)

  result = {"fwd_ms": _time(forward, (q, k, v), iters)}
  result["fwd_tflops"] = config.forward_flops() / result["fwd_ms"] / 1e9
  if backward:
    total = _time(forward_backward, (q, k, v, dout), iters)
    result["bwd_ms"] = max(total - result["fwd_ms"], 1e-6)
    result["bwd_tflops"] = 2.5 * config.forward_flops() / result["bwd_ms"] / 1e9
  return result


def packed_document_ids(seq: int, num_docs: int, seed: int = 0):
  """[1, seq] int32 ids of num_docs back-to-back documents of random lengths."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, seq), num_docs - 1, replace=False))
  lengths = np.diff(np.concatenate([[0], cuts, [seq]]))
  return jnp.asarray(np.repeat(np.arange(num_docs), lengths)[None], jnp.int32), lengths


def measure_packed(config: Config, segment_ids, iters: int = 10) -> dict:
  """Like ``measure`` for jax_flash on one packed row: causal within each
  document (``segment_ids``), or over the whole row when it is None."""
  q, k, v, dout = inputs(config)
  attend = lambda q, k, v: jax_flash.attention(q, k, v, causal=True, segment_ids=segment_ids,
                                               implementation="flash")

  @jax.jit
  def forward_backward(q, k, v, dout):
    return jax.vjp(attend, q, k, v)[1](dout)

  fwd_ms = _time(jax.jit(attend), (q, k, v), iters)
  total = _time(forward_backward, (q, k, v, dout), iters)
  return {"fwd_ms": fwd_ms, "bwd_ms": max(total - fwd_ms, 1e-6)}


def measure_cudnn_packed(config: Config, lengths, iters: int = 10):
  """cuDNN on the same packed row through JAX's segment offsets (a private
  JAX API: ``jax._src.cudnn``; jax.nn does not expose packing). Returns the
  timings and its output, so that callers can check it."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  q, k, v, dout = inputs(config)
  seqlen = jnp.asarray(lengths, jnp.int32)[None]
  offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(seqlen[0])])[None]
  scale = 1.0 / float(np.sqrt(config.head_dim))

  def attend(q, k, v):
    return cudnn.dot_product_attention(q, k, v, None, None, seqlen, seqlen, offsets, offsets,
                                       scale=scale, mask_type=cudnn.MaskType.PADDING_CAUSAL)

  @jax.jit
  def forward_backward(q, k, v, dout):
    return jax.vjp(attend, q, k, v)[1](dout)

  fwd_ms = _time(jax.jit(attend), (q, k, v), iters)
  total = _time(forward_backward, (q, k, v, dout), iters)
  return {"fwd_ms": fwd_ms, "bwd_ms": max(total - fwd_ms, 1e-6)}, jax.jit(attend)(q, k, v)


def matmul_ceiling_tflops(n: int = 8192, iters: int = 20) -> float:
  """bf16 matrix-product rate measured on random data on this device."""
  keys = jax.random.split(jax.random.key(1))
  a = jax.random.normal(keys[0], (n, n), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(keys[1], (n, n), jnp.float32).astype(jnp.bfloat16)
  ms = _time(jax.jit(jnp.matmul), (a, b), iters)
  return 2.0 * n ** 3 / ms / 1e9


def rows(impl: str, config: Config, result: dict, ceiling: float | None, variant: str = "") -> list:
  """DESIGN.md §8 rows for one measurement."""
  device = jax.devices()[0]
  common = {
      "impl": impl, "dtype": config.dtype, "batch": config.batch, "seq_q": config.seq,
      "seq_k": config.seq, "heads_q": config.heads, "heads_kv": config.heads_kv or config.heads,
      "head_dim": config.head_dim, "head_dim_v": config.head_dim, "causal": config.causal,
      "window": None, "variant": variant, "gbps": None, "gpu": device.device_kind,
      "jax": jax.__version__, "date": datetime.date.today().isoformat(),
      "matmul_ceiling_tflops": None if ceiling is None else round(ceiling, 1),
  }
  out = []
  for op in ("fwd", "bwd"):
    if f"{op}_ms" in result:
      out.append({**common, "op": op, "tflops": round(result[f"{op}_tflops"], 1),
                  "ms": round(result[f"{op}_ms"], 4)})
  return out
