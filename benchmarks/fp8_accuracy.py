"""FP8 attention's error under each scaling scheme, against float64
attention over the unquantised float32 inputs and beside bfloat16
attention, on the CPU (docs/fp8.md has the table).

    python benchmarks/fp8_accuracy.py --out benchmarks/results/cpu-DATE-fp8-accuracy.json

Inputs, ``[batch, seq, heads, head_dim]`` (GQA 8 query / 2 kv heads):

* ``gaussian``: q, k, v standard normal.
* ``outlier-channels``: the same with four channels, the same in q and k,
  100x larger in every token (the outlier channels that queries and keys
  of trained models share), q then scaled by 1e-3 so that the logits keep
  a standard deviation near 2 (a scale on q is what the softmax scale
  does; per-tensor scaling is blind to it).
* ``key-outlier-channels``: four channels of k alone 100x larger, q
  standard normal (logits with a standard deviation near 18).
* ``sparse-outliers``: FlashAttention-3's test inputs: q, k, v standard
  normal plus, at 0.1% of the entries, N(0, 10^2).

Schemes (``jax_flash.quantize_fp8``, then ``fp8_attention``, whose maths
dequantise and compute in float32; output bfloat16):

* ``tensor``: one scale per tensor for q, k and v.
* ``head``: per (batch, head).
* ``block``: q and k per (batch, head, 64 rows), v per head.
* ``block+hadamard``: the same after ``hadamard_rotate`` of q and k.
* ``bfloat16``: ``jax_flash.attention`` on the inputs cast to bfloat16.

Per row: ``out_max_error`` (largest error over the largest reference
magnitude), ``out_rms_error`` (RMS error over RMS reference), and
``rms_vs_bfloat16`` (RMS difference from the bfloat16 output over its RMS).

With ``--paged``, rows ``op: "paged_fp8_accuracy"`` compare the FP8 paged
cache's scales per token and kv head (the cache's format) with one scale
per page (64 tokens) and kv head, for decode queries over 4096 cached
tokens, gaussian or with 1% of the tokens' keys and values 100x larger.
"""

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _reference as reference

SCHEMES = ("tensor", "head", "block", "block+hadamard")
BLOCK = 64
OUTLIER = 100.0
INPUTS = ("gaussian", "outlier-channels", "key-outlier-channels", "sparse-outliers")


def make_inputs(kind, seed, batch, seq, heads_q, heads_kv, head_dim):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (batch, seq, heads_q, head_dim))
  k = jax.random.normal(keys[1], (batch, seq, heads_kv, head_dim))
  v = jax.random.normal(keys[2], (batch, seq, heads_kv, head_dim))
  if kind == "outlier-channels":
    channels = np.random.default_rng(seed).choice(head_dim, 4, replace=False)
    q = q.at[..., channels].multiply(OUTLIER) * 1e-3
    k = k.at[..., channels].multiply(OUTLIER)
  elif kind == "key-outlier-channels":
    k = k.at[..., np.random.default_rng(seed).choice(head_dim, 4, replace=False)].multiply(OUTLIER)
  elif kind == "sparse-outliers":
    def sparse(x, key):
      hit = jax.random.uniform(key, x.shape) < 1e-3
      return x + jnp.where(hit, 10 * jax.random.normal(jax.random.fold_in(key, 1), x.shape), 0)
    q, k, v = (sparse(x, jax.random.fold_in(keys[i], 7)) for i, x in enumerate((q, k, v)))
  return q, k, v


def errors(got, truth, bf16):
  got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
  rms = lambda x: np.sqrt(np.mean(x**2))
  return {"out_max_error": round(float(np.abs(got - truth).max() / np.abs(truth).max()), 6),
          "out_rms_error": round(float(rms(got - truth) / rms(truth)), 6),
          "rms_vs_bfloat16": round(float(rms(got - bf16) / rms(bf16)), 6)}


def scheme_output(q, k, v, scheme):
  if scheme.endswith("hadamard"):
    q, k = jax_flash.hadamard_rotate(q), jax_flash.hadamard_rotate(k)
  granularity = scheme.split("+")[0]
  (q8, qs), (k8, ks) = (jax_flash.quantize_fp8(x, granularity=granularity, block_size=BLOCK)
                        for x in (q, k))
  v8, vs = jax_flash.quantize_fp8(v, granularity="tensor" if granularity == "tensor" else "head")
  return jax_flash.fp8_attention(q8, k8, v8, qs, ks, vs, causal=True,
                                 block_size=BLOCK if granularity == "block" else None)


def attention_rows(args):
  rows = []
  for kind in INPUTS:
    for head_dim in args.head_dims:
      shape = (args.batch, args.seq, 8, 2, head_dim)
      q, k, v = make_inputs(kind, args.seed, *shape)
      with jax.enable_x64(True):
        truth, _ = reference.attention_reference(
            *(jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v)),
            scale=head_dim ** -0.5, window_right=0)
        truth = np.asarray(truth)
      bf16 = jax_flash.attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), causal=True)
      bf16_64 = np.asarray(bf16.astype(jnp.float32), np.float64)
      outputs = {"bfloat16": bf16, **{s: scheme_output(q, k, v, s) for s in SCHEMES}}
      for scheme, out in outputs.items():
        rows.append(dict(
            impl="jax_flash", op="fp8_accuracy",
            dtype="bfloat16" if scheme == "bfloat16" else "float8_e4m3fn", batch=args.batch,
            seq_q=args.seq, seq_k=args.seq, heads_q=8, heads_kv=2, head_dim=head_dim,
            head_dim_v=head_dim, causal=True, window=None, variant=scheme, tflops=None, ms=None,
            gbps=None, inputs=kind, **errors(out, truth, bf16_64)))
        print(kind, head_dim, scheme, rows[-1]["out_max_error"], rows[-1]["out_rms_error"],
              flush=True)
  return rows


def per_page_scales(x, page_size):
  """x [B, S, H, D] quantised with one scale per page of tokens and head,
  dequantised (the alternative to the cache's per-token scales)."""
  codes, descale = jax_flash.quantize_fp8(x, granularity="block", block_size=page_size)
  return jax_flash.dequantize_fp8(codes, descale, page_size)


def per_token_scales(x):
  batch, seq, heads, dim = x.shape
  codes, descale = jax_flash.quantize_fp8(x.reshape(batch * seq, 1, heads, dim))
  return jax_flash.dequantize_fp8(codes, descale).reshape(x.shape)


def paged_rows(args):
  """Decode queries (one per sequence) against a cache whose keys carry
  outlier channels and tokens: per-token vs per-page scales, the attention
  computed in float64 on the dequantised cache."""
  rows = []
  page_size, head_dim, seq = 64, 128, 4096
  for kind in ("gaussian", "outlier-tokens"):
    q, k, v = make_inputs("gaussian", args.seed + 1, args.batch, seq, 8, 2, head_dim)
    q = q[:, -1:]  # one decode query per sequence
    if kind == "outlier-tokens":  # 1% of the cached tokens 100x larger, keys and values
      tokens = np.random.default_rng(args.seed).choice(seq, seq // 100, replace=False)
      k, v = (x.at[:, tokens].multiply(OUTLIER) for x in (k, v))

    def attend(keys, values):
      with jax.enable_x64(True):
        out, _ = reference.attention_reference(
            *(jnp.asarray(np.asarray(x), jnp.float64) for x in (q, keys, values)),
            scale=head_dim ** -0.5)
        return np.asarray(out)

    truth = attend(k, v)
    bf16 = attend(k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
    for variant, (keys, values) in {
        "bfloat16": (k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)),
        "per-token": (per_token_scales(k), per_token_scales(v)),
        "per-page": (per_page_scales(k, page_size), per_page_scales(v, page_size))}.items():
      rows.append(dict(
          impl="jax_flash", op="paged_fp8_accuracy", dtype="bfloat16",
          kv_dtype="bfloat16" if variant == "bfloat16" else "float8_e4m3fn", batch=args.batch,
          seq_q=1, seq_k=seq, heads_q=8, heads_kv=2, head_dim=head_dim, head_dim_v=head_dim,
          causal=False, window=None, variant=variant, tflops=None, ms=None, gbps=None,
          inputs=kind, page_size=page_size, **errors(attend(keys, values), truth, bf16)))
      print(kind, "paged", variant, rows[-1]["out_max_error"], rows[-1]["out_rms_error"],
            flush=True)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=1024)
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--paged", action="store_true")
  parser.add_argument("--out", type=pathlib.Path)
  args = parser.parse_args()
  rows = attention_rows(args) + (paged_rows(args) if args.paged else [])
  if args.out:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(__file__)).stdout.strip() or None
    run = {"gpu": "cpu", "jax": jax.__version__, "date": datetime.date.today().isoformat(),
           "commit": commit, "command": "python benchmarks/fp8_accuracy.py " + " ".join(sys.argv[1:]),
           "note": (f"{os.cpu_count()} CPU cores; errors against float64 attention over the "
                    "unquantised float32 inputs; FP8 maths: dequantise, float32 attention, "
                    "bfloat16 output; causal")}
    args.out.write_text(json.dumps({"run": run, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
  main()
