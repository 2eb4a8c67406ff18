"""Timing attention implementations side by side, in one process.

Used by ``python -m jax_flash`` and the scripts in ``benchmarks/``. Rows and
results files follow docs/numerics.md ("Results format"): forward TFLOPS
count ``4 * B * N * T * S * D`` (halved for causal when T == S); the backward
counts 2.5x that and is timed as (forward + backward) - forward.

Implementations: ``jax_flash``; cuDNN and XLA through
``jax.nn.dot_product_attention``; ``pallas_mgpu``, JAX's Pallas Mosaic GPU
attention (``jax.experimental.pallas.ops.gpu.attention_mgpu``: Hopper, float16).
"""

import dataclasses
import datetime
import functools
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash

IMPLEMENTATIONS = ("jax_flash", "cudnn", "pallas_mgpu", "xla")
BACKWARD_FLOP_FACTOR = 2.5


@dataclasses.dataclass(frozen=True)
class Config:
  batch: int
  seq: int
  heads: int
  head_dim: int
  causal: bool
  dtype: str = "bfloat16"
  heads_kv: int | None = None
  head_dim_v: int | None = None  # None: head_dim

  @property
  def value_dim(self) -> int:
    return self.head_dim_v or self.head_dim

  @property
  def dims_label(self) -> str:
    """``192`` or, with a narrower V, ``192/128``."""
    return str(self.head_dim) if self.value_dim == self.head_dim else f"{self.head_dim}/{self.value_dim}"

  def forward_flops(self) -> float:
    # Q K^T and P V: 2 * seq * seq multiply-adds per head over each width.
    flops = 2.0 * self.batch * self.heads * self.seq * self.seq * (self.head_dim + self.value_dim)
    return flops / 2 if self.causal else flops

  def backward_flops(self) -> float:
    return BACKWARD_FLOP_FACTOR * self.forward_flops()


def skip_reason(impl: str, dtype: str) -> str | None:
  """Why ``impl`` cannot run at all in this process with ``dtype``, or None.
  Per-configuration limits show up as errors from ``measure`` instead."""
  if impl != "pallas_mgpu":
    return None
  if jnp.dtype(dtype) != jnp.float16:
    # The kernel stages its tiles in float16 shared memory whatever the input dtype.
    return "fp16 only"
  device = jax.devices()[0]
  if getattr(device, "compute_capability", None) != "9.0":
    return f"needs a Hopper GPU (compute capability 9.0), this is {device.device_kind}"
  try:
    from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: F401
  except ImportError as e:
    return f"attention_mgpu does not import: {e}"
  return None


def attention_fn(impl: str, config: Config, **options):
  """A function (q, k, v) -> out for one implementation name. ``options`` are
  extra keywords of ``jax_flash.attention`` (e.g. ``deterministic=True``)."""
  if options and impl != "jax_flash":
    raise ValueError(f"options {sorted(options)} apply to jax_flash only, got impl {impl!r}")
  if impl == "jax_flash":
    return lambda q, k, v: jax_flash.attention(q, k, v, causal=config.causal,
                                               implementation="flash", **options)
  if impl in ("cudnn", "xla"):
    return _padding_values(config, lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=config.causal, implementation=impl))
  if impl == "pallas_mgpu":
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    tuning = pallas_mgpu_tuning(config)
    # The kernel applies no softmax scale (callers fold it into q). Timing it on
    # the unscaled inputs does the same work without an extra pass over q.
    return _padding_values(config, lambda q, k, v: attention_mgpu.attention(q, k, v, tuning))
  raise ValueError(f"unknown implementation {impl!r}")


def _padding_values(config: Config, attend):
  """``attend`` for a narrower V as its users must call it: V zero-padded to
  the query head dim and the output cut back (jax.nn.dot_product_attention
  and attention_mgpu take one head dim for q, k and v)."""
  padding = config.head_dim - config.value_dim
  if not padding:
    return attend
  widen = [(0, 0)] * 3 + [(0, padding)]
  return lambda q, k, v: attend(q, k, jnp.pad(v, widen))[..., :config.value_dim]


# Forward: 64 query rows per compute warpgroup and the widest key block whose two
# pipelined K/V stages fit in shared memory (256 keys at head dim 64, 128 at 128,
# 64 at 256), the choice attention_mgpu's own benchmark makes.
PALLAS_MGPU_FORWARD_TILES = tuple(dict(block_q=64, block_kv=block_kv, max_concurrent_steps=2)
                                  for block_kv in (256, 128, 64))


# Backward: two compute warpgroups before one, larger blocks before smaller; the
# tuple is (block_q_dq, block_kv_dq, block_q_dkv, block_kv_dkv). The first that
# fits in shared memory is used.
PALLAS_MGPU_BACKWARD_TILES = tuple(
    dict(block_q_dq=q_dq, block_kv_dq=kv_dq, block_q_dkv=q_dkv, block_kv_dkv=kv_dkv,
         compute_wgs_bwd=warpgroups)
    for warpgroups in (2, 1)
    for q_dq, kv_dq, q_dkv, kv_dkv in ((128, 128, 128, 128), (64, 128, 128, 64), (64, 64, 64, 64)))


@functools.cache
def pallas_mgpu_tuning(config: Config):
  """The first attention_mgpu TuningConfig whose kernels fit in shared memory
  for ``config``, checked by lowering (where Mosaic GPU sizes them)."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu

  q, k, v, dout = jax.eval_shape(lambda: inputs(config))

  def fits(tuning, backward: bool) -> bool:
    attend = lambda q, k, v: attention_mgpu.attention(q, k, v, tuning)
    if backward:
      fn, args = (lambda q, k, v, dout: jax.vjp(attend, q, k, v)[1](dout)), (q, k, v, dout)
    else:
      fn, args = attend, (q, k, v)
    try:
      jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    except ValueError as e:
      if "exceeds available shared memory" in str(e):
        return False
      raise
    return True

  for tiles in PALLAS_MGPU_FORWARD_TILES:
    forward = attention_mgpu.TuningConfig(causal=config.causal, **tiles)
    if fits(forward, backward=False):
      break
  else:
    raise NotImplementedError(f"no attention_mgpu forward tile fits in shared memory at "
                              f"head_dim={config.head_dim}")
  candidates = [dataclasses.replace(forward, **tiles) for tiles in PALLAS_MGPU_BACKWARD_TILES]
  for tuning in candidates:
    try:
      if fits(tuning, backward=True):
        return tuning
    except Exception:  # no backward here (causal, in JAX 0.10 and 0.11): measure() reports why
      return tuning
  return candidates[-1]  # measure() reports that the backward exceeds shared memory


def _time(fn, args, iters: int | None = None, reps: int = 5, seconds: float = 0.25) -> float:
  """Median milliseconds per call over `reps` loops of `iters` calls. Without
  `iters`, each loop makes enough calls that all loops last about `seconds`,
  so short and long problems cost the sweep similar time."""
  jax.block_until_ready(fn(*args))
  if iters is None:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    iters = max(1, round(seconds / reps / (time.perf_counter() - start)))
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
  shape_v = (*shape_kv[:3], config.value_dim)
  shape_out = (*shape_q[:3], config.value_dim)
  dtype = jnp.dtype(config.dtype)
  make = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(dtype)
  return (make(keys[0], shape_q), make(keys[1], shape_kv), make(keys[2], shape_v),
          make(keys[3], shape_out))


def error_summary(error: Exception, width: int = 100) -> str:
  """``Type: first line of the message``, cut to ``width`` characters."""
  lines = str(error).splitlines() or [""]
  return f"{type(error).__name__}: {lines[0]}"[:width]


def measure(impl: str, config: Config, iters: int | None = 10, backward: bool = True,
            **options) -> dict:
  """Forward (and backward) milliseconds and TFLOPS of one implementation.
  ``iters=None`` sizes the timing loops by time (see ``_time``). A backward
  that fails (an implementation without one) leaves ``bwd_error`` in place of
  the backward numbers; a failing forward raises."""
  q, k, v, dout = inputs(config)
  attend = attention_fn(impl, config, **options)
  forward = jax.jit(attend)

  @jax.jit
  def forward_backward(q, k, v, dout):
    out, pullback = jax.vjp(attend, q, k, v)
    return pullback(dout)

  result = {"fwd_ms": _time(forward, (q, k, v), iters)}
  result["fwd_tflops"] = config.forward_flops() / result["fwd_ms"] / 1e9
  if backward:
    try:
      total = _time(forward_backward, (q, k, v, dout), iters)
    except Exception as e:  # reported with the forward numbers, which stand on their own
      result["bwd_error"] = error_summary(e)
      return result
    result["bwd_ms"] = max(total - result["fwd_ms"], 1e-6)
    result["bwd_tflops"] = config.backward_flops() / result["bwd_ms"] / 1e9
  return result


def packed_document_ids(seq: int, num_docs: int, seed: int = 0):
  """[1, seq] int32 ids of num_docs back-to-back documents of random lengths."""
  rng = np.random.default_rng(seed)
  cuts = np.sort(rng.choice(np.arange(1, seq), num_docs - 1, replace=False))
  lengths = np.diff(np.concatenate([[0], cuts, [seq]]))
  return jnp.asarray(np.repeat(np.arange(num_docs), lengths)[None], jnp.int32), lengths


def measure_packed(config: Config, segment_ids, iters: int | None = 10) -> dict:
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


def measure_cudnn_packed(config: Config, lengths, iters: int | None = 10):
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


def matmul_ceiling_tflops(n: int = 8192, iters: int = 20, dtype: str = "bfloat16") -> float:
  """Matrix-product rate in ``dtype`` measured on random data on this device."""
  keys = jax.random.split(jax.random.key(1))
  a = jax.random.normal(keys[0], (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(keys[1], (n, n), jnp.float32).astype(dtype)
  ms = _time(jax.jit(jnp.matmul), (a, b), iters)
  return 2.0 * n ** 3 / ms / 1e9


def rows(impl: str, config: Config, result: dict, ceiling: float | None, variant: str = "") -> list:
  """Result rows for one measurement, each carrying the fields that
  ``run_header`` later moves into its run's header (gpu, jax, date)."""
  device = jax.devices()[0]
  common = {
      "impl": impl, "dtype": config.dtype, "batch": config.batch, "seq_q": config.seq,
      "seq_k": config.seq, "heads_q": config.heads, "heads_kv": config.heads_kv or config.heads,
      "head_dim": config.head_dim, "head_dim_v": config.value_dim, "causal": config.causal,
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


# A results file holds one run: {"run": header, "rows": [...]}. The header says
# once what every row shares; rows keep the configuration and the numbers.
ROW_FIELDS = ("impl", "op", "dtype", "batch", "seq_q", "seq_k", "heads_q", "heads_kv", "head_dim",
              "head_dim_v", "causal", "window", "variant", "tflops", "ms", "gbps")
# A header may add fields of its own: "number" (the run's place in its GPU's
# series), a matmul ceiling shared by every row.
RUN_FIELDS = ("gpu", "jax", "date", "commit", "command", "note")


def run_header(rows: list, number: int, commit: str | None, command: str | None,
               note: str | None) -> dict:
  """The header of a run made of ``rows`` as ``rows()`` writes them: what
  they all share, the first date (a run may pass midnight) and the matmul
  ceiling when one was measured for all."""
  for field in ("gpu", "jax"):
    values = {row[field] for row in rows}
    if len(values) != 1:
      raise ValueError(f"one run holds one {field}, these rows hold {sorted(map(str, values))}")
  header = {"number": number, "gpu": rows[0]["gpu"], "jax": rows[0]["jax"],
            "date": min(row["date"] for row in rows), "commit": commit, "command": command,
            "note": note}
  ceilings = {row.get("matmul_ceiling_tflops") for row in rows}
  if len(ceilings) == 1 and None not in ceilings:
    header["matmul_ceiling_tflops"] = ceilings.pop()
  return header


def run_document(run: dict, rows: list) -> str:
  """The text of a results file: the header indented, then one row a line
  (short files that diff line by line). Fields the header holds are left
  out of the rows."""
  missing = [field for field in RUN_FIELDS if field not in run]
  if missing:
    raise ValueError(f"run header lacks {missing}")
  lines = []
  for row in rows:
    absent = [field for field in ROW_FIELDS if field not in row]
    if absent:
      raise ValueError(f"row lacks {absent}: {row}")
    ordered = {field: row[field] for field in ROW_FIELDS}
    ordered |= {k: v for k, v in row.items() if k not in ordered and k not in run and k != "run"}
    lines.append(json.dumps(ordered, separators=(",", ":")))
  header = json.dumps(run, indent=2).replace("\n", "\n  ")
  return '{\n  "run": ' + header + ',\n  "rows": [\n' + ",\n".join(lines) + "\n  ]\n}\n"


def read_rows(path) -> list:
  """The rows of one JSON file: a results file's rows with its header's
  fields added to each (its ``number``, if any, as ``run``), or a bare list
  of rows as the benchmark scripts' ``--out`` writes them."""
  loaded = json.loads(pathlib.Path(path).read_text())
  if isinstance(loaded, list):
    return loaded
  if not isinstance(loaded, dict) or "rows" not in loaded:
    raise ValueError(f"{path}: neither a results file nor a list of rows")
  run = loaded["run"]
  shared = {k: v for k, v in run.items() if k != "number"} | {"run": run.get("number")}
  return [shared | row for row in loaded["rows"]]


def read_runs(directory) -> list:
  """``(path, header, rows)`` of every results file in ``directory``, in name
  order (names start with the GPU and the date). Other JSON files there
  (kernel times, clocks) are skipped."""
  runs = []
  for path in sorted(pathlib.Path(directory).glob("*.json")):
    loaded = json.loads(path.read_text())
    if isinstance(loaded, dict) and "run" in loaded and "rows" in loaded:
      runs.append((path, loaded["run"], loaded["rows"]))
  return runs


def processor_name() -> str:
  """The CPU model for a results header (/proc/cpuinfo, else JAX's device kind)."""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return jax.devices("cpu")[0].device_kind

