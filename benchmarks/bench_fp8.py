"""FP8 attention forward: jax_flash's Hopper FP8 kernel against cuDNN's FP8
attention and jax_flash's bfloat16 forward, in one process on one GPU.

    python benchmarks/bench_fp8.py --out gpu_out/bench_fp8.json
    python benchmarks/bench_fp8.py --head-dims 128 256 --seqs 8192 --causal both

Each configuration keeps ``--tokens`` tokens per batch (batch = tokens / seq)
and ``--heads`` heads (issue 51 measured cuDNN at B2 T8192 N16). Rows:

* ``jax_flash`` ``float8_e4m3fn``: ``fp8_attention(implementation="flash")``
  with per-head descales, bfloat16 output, as a user calls it: the XLA pass
  that writes V transposed (jax_flash/_fp8_kernel.py) is included.
* ``jax_flash`` ``float8_e4m3fn`` ``v-pretransposed``: the kernel alone on a V
  transposed beforehand: the difference is what an in-kernel transpose could
  save at most.
* ``cudnn`` ``float8_e4m3fn``: JAX's private
  ``fused_attention_stablehlo.dot_product_attention(use_fp8=True)`` (no
  public API; unit scales, FP8 output, no lengths), the issue's anchor.
* ``jax_flash`` ``bfloat16``: ``jax_flash.attention`` forward on the same
  inputs in bfloat16.

Prints TFLOPS and the ratio of each row to cuDNN FP8; ``--out`` writes one
results file (docs/numerics.md's format; ``benchmarks/add_run.py`` files it).
"""

import argparse
import datetime
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _benchmark as benchmark
from jax_flash import _fp8_kernel as fp8_kernel

FP8 = "float8_e4m3fn"


def quantized_inputs(config: benchmark.Config):
  """((q8, k8, v8), (q, k, v) bfloat16, descales) from the same normal draws."""
  q, k, v, _ = benchmark.inputs(config)
  codes, descales = zip(*(jax_flash.quantize_fp8(x.astype(jnp.float32)) for x in (q, k, v)))
  return jax.block_until_ready(codes), (q, k, v), jax.block_until_ready(descales)


def cudnn_fp8(config: benchmark.Config):
  """cuDNN's FP8 forward through JAX's private API, unit scales."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn

  params = {key: jnp.ones((1, 1, 1, 1), jnp.float32) for key in cudnn.fp8_params_keys}
  mask = cudnn.MaskType.CAUSAL if config.causal else cudnn.MaskType.NO_MASK
  scale = config.head_dim ** -0.5

  def attend(q, k, v):
    return cudnn.dot_product_attention(q, k, v, fp8_params=params, scale=scale, mask_type=mask,
                                       qkv_layout="BTNH", use_fp8=True)[0]
  return attend


def timings(config: benchmark.Config):
  """{(impl, dtype, variant): milliseconds or an error string}."""
  codes, bf16, descales = quantized_inputs(config)
  calls = {
      ("cudnn", FP8, ""): (cudnn_fp8(config), codes),
      ("jax_flash", FP8, ""): (lambda q, k, v, *s: jax_flash.fp8_attention(
          q, k, v, *s, causal=config.causal, implementation="flash"), (*codes, *descales)),
      ("jax_flash", "bfloat16", ""): (lambda q, k, v: jax_flash.attention(
          q, k, v, causal=config.causal, implementation="flash"), bf16),
  }
  batch = codes[0].shape[0]
  lens = (jnp.full((batch,), config.seq, jnp.int32),) * 2
  v_t = jax.block_until_ready(fp8_kernel.value_transposed(codes[2], lens[1]))
  mask = dict(scale=config.head_dim ** -0.5, diag_offset=0, window_left=-1,
              window_right=0 if config.causal else -1)
  calls["jax_flash", FP8, "v-pretransposed"] = (
      lambda q, k, v_t, *rest: jax.ffi.ffi_call(fp8_kernel._TARGET, (
          jax.ShapeDtypeStruct((*q.shape[:3], v_t.shape[2]), jnp.bfloat16),
          jax.ShapeDtypeStruct((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)))(
              q, k, v_t, *rest, scale=np.float32(mask["scale"]), diag_offset=np.int32(0),
              window_left=np.int32(-1), window_right=np.int32(mask["window_right"])),
      (codes[0], codes[1], v_t, *lens, *descales))
  out = {}
  for key, (fn, args) in calls.items():
    try:
      out[key] = benchmark._time(jax.jit(fn), args)
    except Exception as e:  # an implementation that rejects the shape is reported
      out[key] = benchmark.error_summary(e)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
  parser.add_argument("--causal", choices=("both", "true", "false"), default="both")
  parser.add_argument("--tokens", type=int, default=16384)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--out", type=pathlib.Path, help="results file to write (one run)")
  parser.add_argument("--note", default="")
  args = parser.parse_args(argv)
  causal_values = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
  device = jax.devices()[0]
  rows = []
  print(f"{'hd':>4}{'seq':>7}{'causal':>7}  {'impl':<36}{'ms':>9}{'TFLOPS':>8}{'/cuDNN fp8':>11}",
        flush=True)
  for head_dim in args.head_dims:
    for seq in args.seqs:
      for causal in causal_values:
        config = benchmark.Config(max(args.tokens // seq, 1), seq, args.heads, head_dim, causal)
        measured = timings(config)
        anchor = measured.get(("cudnn", FP8, ""))
        anchor_tflops = config.forward_flops() / anchor / 1e9 if isinstance(anchor, float) else None
        for (impl, dtype, variant), ms in measured.items():
          label = ":".join(filter(None, (impl, dtype, variant)))
          if not isinstance(ms, float):
            print(f"{head_dim:>4}{seq:>7}{str(causal):>7}  {label:<36}failed: {ms}", flush=True)
            continue
          tflops = config.forward_flops() / ms / 1e9
          ratio = f"{tflops / anchor_tflops:>11.2f}" if anchor_tflops else f"{'-':>11}"
          print(f"{head_dim:>4}{seq:>7}{str(causal):>7}  {label:<36}{ms:>9.3f}{tflops:>8.1f}{ratio}",
                flush=True)
          rows.append({"impl": impl, "op": "fwd", "dtype": dtype, "batch": config.batch,
                       "seq_q": seq, "seq_k": seq, "heads_q": args.heads, "heads_kv": args.heads,
                       "head_dim": head_dim, "head_dim_v": head_dim, "causal": causal,
                       "window": None, "variant": variant, "tflops": round(tflops, 1),
                       "ms": round(ms, 4), "gbps": None})
  if args.out:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    header = {"gpu": device.device_kind, "jax": jax.__version__,
              "date": datetime.date.today().isoformat(), "commit": commit,
              "command": "python " + " ".join(["benchmarks/bench_fp8.py", *(argv or sys.argv[1:])]),
              "note": args.note}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"run": header, "rows": rows}, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
