"""MLA's FP8 latent cache: how far the RoPE-aware per-token scheme moves the
attention output and probabilities from float32, beside the bfloat16 cache
and a naive FP8 scheme, on the CPU.

    python benchmarks/mla_accuracy.py --out benchmarks/results/cpu-DATE-mla-accuracy.json

Inputs (a batch of sequences, the last --s-q tokens of each its queries):

* ``gaussian``: every query and cache column N(0, 1) (tests/test_mla.py's
  inputs).
* ``outliers-S``: the regime SnapMLA describes: the latent tightly around
  0 (N(0, S^2), S from 1 to 0.003), the RoPE columns with heavy channels,
  amplitudes up to 1e3, rotated by position.
* ``mla_layer``: a small randomly initialised MLA layer (DeepSeek-V2's
  structure: pre-norm, the latent through its RMSNorm, the RoPE key
  unnormalised, real rotary embedding, queries absorbed through W_UK) on
  hidden states with two massive-activation channels.

Schemes, each against float64 attention over the float32 inputs, outputs in
bfloat16 as the kernels return them:

* ``bfloat16``: the bfloat16 cache (``mla_decode``, exact in float32).
* ``fp8_rope_aware``: ``MlaFp8Cache`` through ``mla_decode``, the Hopper
  kernel's maths (queries quantised likewise, P requantised per row and
  64-key block).
* ``fp8_rope_aware_dequantized``: the same quantised query and cache,
  dequantised, float32 attention: the quantisation's error alone.
* ``fp8_naive_dequantized``: one e4m3 scale per token (and per query head)
  over all 576 columns, RoPE included, dequantised, float64 attention.

Per scheme: ``out_max_error`` (largest error over the largest reference
magnitude), ``out_rms_error`` (RMS error over RMS reference) and the
Kullback-Leibler divergence of each query row's attention probabilities
from the float32 ones (``p_kl_mean`` / ``p_kl_max``, nats; the kernel's P
requantisation acts on P V, so both RoPE-aware schemes share it).
"""

import argparse
import datetime
import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash
from jax_flash import _benchmark as benchmark
from jax_flash import _mla as mla, _mla_fp8 as mla_fp8

SCALE = 192 ** -0.5  # DeepSeek-V2/V3 without YaRN
LATENT, ROPE, WIDTH = mla_fp8.LATENT_DIM, mla_fp8.ROPE_DIM, mla_fp8.HEAD_DIM
ROPE_THETA = 10000.0
SCHEMES = ("bfloat16", "fp8_rope_aware", "fp8_rope_aware_dequantized", "fp8_naive_dequantized")


def rotary(x, positions):
  """Rotary position embedding of ``x [..., tokens, 64]`` (pairs of
  adjacent channels rotated by position times their frequency)."""
  frequencies = ROPE_THETA ** (-np.arange(0, ROPE, 2) / ROPE)
  angle = positions[:, None] * frequencies[None]  # [tokens, 32]
  cos, sin = np.cos(angle), np.sin(angle)
  even, odd = x[..., 0::2], x[..., 1::2]
  out = np.empty_like(x)
  out[..., 0::2] = even * cos - odd * sin
  out[..., 1::2] = even * sin + odd * cos
  return out


def gaussian_inputs(rng, batch, seq_k, s_q, heads):
  rows = rng.standard_normal((batch, seq_k, WIDTH))
  return rows, rng.standard_normal((batch, s_q, heads, WIDTH))


def outlier_inputs(rng, batch, seq_k, s_q, heads, latent_std):
  """Latent N(0, latent_std^2); each RoPE channel pair with a fixed
  amplitude, 10^(3 u^2) for u uniform (most near 1, a few near 1e3), and a
  random phase per token, rotated by position. Query latent and RoPE
  scaled so that each half of a logit has a standard deviation near 1."""
  positions = np.arange(seq_k, dtype=np.float64)
  amplitude = 10.0 ** (3 * rng.random(ROPE // 2) ** 2)
  phase = rng.uniform(0, 2 * np.pi, (batch, seq_k, ROPE // 2))
  rope = np.stack([amplitude * np.cos(phase), amplitude * np.sin(phase)], -1).reshape(
      batch, seq_k, ROPE)
  rows = np.concatenate([latent_std * rng.standard_normal((batch, seq_k, LATENT)),
                         rotary(rope, positions)], axis=-1)
  q_latent = rng.standard_normal((batch, s_q, heads, LATENT)) / (latent_std * np.sqrt(LATENT)
                                                                 * SCALE)
  q_rope = rng.standard_normal((batch, s_q, heads, ROPE)) / (np.sqrt(np.sum(amplitude ** 2))
                                                              * SCALE)
  q_rope = rotary(np.moveaxis(q_rope, 2, 1), positions[seq_k - s_q:])  # each query at its position
  return rows, np.concatenate([q_latent, np.moveaxis(q_rope, 1, 2)], axis=-1)


def rms_norm(x):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def mla_layer_inputs(rng, batch, seq_k, s_q, heads, d_model=1024, nope=128):
  """The cache rows and absorbed queries of one randomly initialised MLA
  layer; weights N(0, 1/fan_in), RMSNorm weights 1."""
  weight = lambda *shape: rng.standard_normal(shape) / np.sqrt(shape[0])
  w_kv = weight(d_model, WIDTH)  # DeepSeek's kv_a_proj_with_mqa: latent and RoPE key
  w_q = weight(d_model, heads * (nope + ROPE))
  w_uk = weight(nope, heads, LATENT)  # the key half of kv_b_proj, per head
  hidden = rng.standard_normal((batch, seq_k, d_model))
  hidden[..., :2] *= 300.0  # two massive-activation channels
  hidden = rms_norm(hidden)  # the layer's input norm
  positions = np.arange(seq_k, dtype=np.float64)
  kv = hidden @ w_kv
  rows = np.concatenate([rms_norm(kv[..., :LATENT]), rotary(kv[..., LATENT:], positions)], -1)
  q = (hidden[:, -s_q:] @ w_q).reshape(batch, s_q, heads, nope + ROPE)
  q_latent = np.einsum("bthn,nhl->bthl", q[..., :nope], w_uk)
  q_rope = np.moveaxis(rotary(np.moveaxis(q[..., nope:], 2, 1), positions[-s_q:]), 1, 2)
  return rows, np.concatenate([q_latent, q_rope], axis=-1)


# The outlier family at three latent scales against the same RoPE columns.
INPUTS = {"gaussian": gaussian_inputs, "mla_layer": mla_layer_inputs,
          **{f"outliers-{std:g}": functools.partial(outlier_inputs, latent_std=std)
             for std in (1.0, 0.1, 0.03, 0.01, 0.003)}}


def naive_dequantize(x):
  """One e4m3 scale per row over all 576 columns (RoPE quantised too)."""
  codes, scales = mla_fp8.quantize_rows(jnp.asarray(x, jnp.float32))
  return np.asarray(codes, np.float64) * np.asarray(scales, np.float64)[..., None]


def aware_dequantize(x):
  return np.asarray(mla_fp8.dequantize_latent(*mla_fp8.quantize_latent(jnp.asarray(x))),
                    np.float64)


def bfloat16_values(x):
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


def log_probabilities(q, rows):
  """float64 log-softmax ``[batch, heads, s_q, seq_k]`` of the scaled
  logits, causal from the bottom right (-inf where masked)."""
  s_q, seq_k = q.shape[1], rows.shape[1]
  logits = np.einsum("bthd,bsd->bhts", q, rows) * SCALE
  visible = np.arange(seq_k)[None] <= seq_k - s_q + np.arange(s_q)[:, None]
  logits = np.where(visible, logits, -np.inf)
  top = logits.max(-1, keepdims=True)
  return logits - top - np.log(np.sum(np.exp(logits - top), -1, keepdims=True))


def attention(q, rows):
  """float64 MLA output ``[batch, s_q, heads, 512]`` rounded to bfloat16."""
  p = np.exp(log_probabilities(q, rows))
  return bfloat16_values(np.einsum("bhts,bsd->bthd", p, rows[..., :LATENT]))


def decode(q, rows, kv_dtype, requantize_p=True):
  """The scheme through jax_flash: ``rows`` written with write_mla_cache
  into a cache of ``kv_dtype``, the last s_q tokens' queries decoded."""
  batch, seq_k, _ = rows.shape
  pages = -(-seq_k // mla_fp8.PAGE_SIZE)
  table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
  lengths = jnp.full((batch,), seq_k, jnp.int32)
  cache = jax.jit(mla.write_mla_cache)(mla.empty_mla_cache(batch * pages, kv_dtype),
                                       jnp.asarray(rows, jnp.bfloat16), table, lengths)
  q = jnp.asarray(q, jnp.bfloat16)
  new = jnp.full((batch,), q.shape[1], jnp.int32)
  if requantize_p:
    out = jax.jit(jax_flash.mla_decode, static_argnames=("scale", "implementation"))(
        q, cache, table, lengths, scale=SCALE, query_lengths=new, implementation="xla")
  else:
    out, _ = jax.jit(mla_fp8.fp8_reference, static_argnames=("scale", "requantize_p"))(
        q, cache, table, lengths, new, scale=SCALE, requantize_p=False)
  return np.asarray(out.astype(jnp.float32), np.float64)


def measure(kind, rng, batch, seq_k, s_q, heads):
  rows, q = INPUTS[kind](rng, batch, seq_k, s_q, heads)
  truth = attention(q, rows)
  truth_logp = log_probabilities(q, rows)
  rows16, q16 = bfloat16_values(rows), bfloat16_values(q)  # what a bfloat16 model holds
  aware_logp = log_probabilities(aware_dequantize(q16), aware_dequantize(rows16))
  outputs = {
      "bfloat16": (decode(q, rows, jnp.bfloat16), log_probabilities(q16, rows16)),
      "fp8_rope_aware": (decode(q, rows, jnp.float8_e4m3fn), aware_logp),
      "fp8_rope_aware_dequantized": (decode(q, rows, jnp.float8_e4m3fn, requantize_p=False),
                                     aware_logp),
  }
  naive_q, naive_rows = naive_dequantize(q16), naive_dequantize(rows16)
  outputs["fp8_naive_dequantized"] = (attention(naive_q, naive_rows),
                                      log_probabilities(naive_q, naive_rows))
  stats = {"latent_rms": float(np.sqrt(np.mean(rows[..., :LATENT] ** 2))),
           "rope_max_abs": float(np.max(np.abs(rows[..., LATENT:])))}
  results = {}
  for scheme in SCHEMES:
    out, logp = outputs[scheme]
    error = out - truth
    seen = np.isfinite(truth_logp)
    kl = np.sum(np.exp(truth_logp) * np.where(seen, truth_logp - np.where(seen, logp, 0), 0),
                axis=-1)
    results[scheme] = {
        "out_max_error": float(np.max(np.abs(error)) / np.max(np.abs(truth))),
        "out_rms_error": float(np.sqrt(np.mean(error ** 2) / np.mean(truth ** 2))),
        "p_kl_mean": float(np.mean(kl)), "p_kl_max": float(np.max(kl)), **stats}
  return results


def row(kind, scheme, batch, seq_k, s_q, heads, result):
  return {"impl": "jax_flash", "op": "mla_accuracy", "dtype": "bfloat16",
          "kv_dtype": "bfloat16" if scheme == "bfloat16" else "float8_e4m3fn",
          "batch": batch, "seq_q": s_q, "seq_k": seq_k, "heads_q": heads, "heads_kv": 1,
          "head_dim": WIDTH, "head_dim_v": LATENT, "causal": True, "window": None,
          "variant": scheme, "tflops": None, "ms": None, "gbps": None, "inputs": kind,
          **{k: float(f"{v:.4g}") for k, v in result.items()}}



def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--seq-k", type=int, nargs="+", default=[1000, 4096])
  parser.add_argument("--s-q", type=int, default=2)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--inputs", nargs="+", default=list(INPUTS), choices=list(INPUTS))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", type=pathlib.Path, help="results file to write (one run)")
  args = parser.parse_args(argv)
  rows = []
  print(f"{'inputs':<14}{'seq_k':>6}  {'scheme':<28}{'max err':>9}{'rms err':>9}{'KL mean':>10}"
        f"{'KL max':>10}", flush=True)
  for kind in args.inputs:
    for seq_k in args.seq_k:
      rng = np.random.default_rng(args.seed)
      results = measure(kind, rng, args.batch, seq_k, args.s_q, args.heads)
      for scheme, result in results.items():
        print(f"{kind:<14}{seq_k:>6}  {scheme:<28}{result['out_max_error']:9.4f}"
              f"{result['out_rms_error']:9.4f}{result['p_kl_mean']:10.2e}"
              f"{result['p_kl_max']:10.2e}", flush=True)
        rows.append(row(kind, scheme, args.batch, seq_k, args.s_q, args.heads, result))
      ratio = (results["fp8_rope_aware_dequantized"]["out_max_error"]
               / results["fp8_naive_dequantized"]["out_max_error"])
      print(f"{'':>22}RoPE-aware / naive max error (quantisation alone): {ratio:.3f}; latent "
            f"RMS {result['latent_rms']:.3g}, RoPE max {result['rope_max_abs']:.3g}", flush=True)
  if args.out:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    run = {"gpu": "cpu", "cpu": benchmark.processor_name(), "jax": jax.__version__,
           "date": datetime.date.today().isoformat(), "commit": commit,
           "command": "python benchmarks/mla_accuracy.py " + " ".join(
               sys.argv[1:] if argv is None else argv),
           "note": f"{os.cpu_count()} CPU cores; errors against float64 attention over the "
                   "float32 inputs, outputs in bfloat16; softmax scale 192 ** -0.5"}
    args.out.write_text(json.dumps({"run": run, "rows": rows}, indent=1) + "\n")
    print(f"wrote {len(rows)} rows to {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
