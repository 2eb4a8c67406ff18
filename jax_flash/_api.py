"""The public attention functions."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash import _gpu_support
from jax_flash import _configs as configs
from jax_flash import _ffi as ffi
from jax_flash import _reference as reference
from jax_flash import _segments as segments
from jax_flash import _validation as validation
from jax_flash import _vjp as vjp
from jax_flash._call import (KernelCall, Mask, MaskOperands, PerPlatform, runs_kernels,
                             sink_operand, whole_lengths)


def _platform_of(*arrays) -> str:
  """The platform the computation runs on: the device of concrete inputs,
  else (inside ``jit``) JAX's default backend."""
  for x in arrays:
    if isinstance(x, jax.Array):
      try:
        return next(iter(x.devices())).platform
      except Exception:  # a tracer has no devices
        continue
  return jax.default_backend()


# Why calls cannot run on the GPU kernels here (no library, no GPU, a GPU
# the compiled kernels do not cover), or None.
_gpu_unavailable_reason = _gpu_support.gpu_unavailable_reason


def select_backend(implementation, platform: str, dtype, shapes: validation.Shapes) -> str:
  """Returns "cpu", "gpu" or "xla" for a call running on ``platform`` (a JAX
  device platform); see ``attention``."""
  if implementation == "xla":
    return "xla"
  requested = implementation if implementation in ("cpu", "gpu") else platform
  if requested not in configs.BACKENDS:
    reason = f"jax_flash has no kernels for platform {platform!r}"
  elif requested == "gpu" and (reason := _gpu_unavailable_reason()):
    pass
  else:
    reason = configs.BACKENDS[requested].unsupported_reason(dtype, shapes.head_dim,
                                                            shapes.head_dim_v)
    if reason is None and requested == "gpu":
      reason = _gpu_support.device_reason("forward", shapes.head_dim)
  if reason is None:
    return requested
  if implementation is None:
    return "xla"
  raise NotImplementedError(f"implementation={implementation!r}: {reason}")


def _lowering_reason(backend: str, dtype, shapes: validation.Shapes) -> str | None:
  """Why the ``backend`` kernels cannot serve a computation lowered for their
  platform, or None. The GPU kernels' presence decides only where this
  process runs CUDA: exported for CUDA elsewhere, a module names them and
  the serving host supplies them."""
  reason = configs.BACKENDS[backend].unsupported_reason(dtype, shapes.head_dim, shapes.head_dim_v)
  if reason is None and backend == "gpu" and ffi.gpu_compute_capability() is not None:
    reason = _gpu_unavailable_reason() or _gpu_support.device_reason("forward", shapes.head_dim)
  return reason


def _per_platform(implementation, call: KernelCall, dtype, shapes) -> PerPlatform | None:
  """The kernel call for each lowering platform (PerPlatform) under
  ``implementation`` None or "flash"; None where none would run a kernel."""
  entries = {}
  for platform, backend in (("cpu", "cpu"), ("cuda", "gpu")):
    reason = _lowering_reason(backend, dtype, shapes)
    if reason is None:
      entries[platform] = dataclasses.replace(call, backend=backend)
    elif implementation is None and not call.batch_invariant:
      entries[platform] = dataclasses.replace(call, backend="xla")
    else:
      entries[platform] = _no_kernel_message(implementation, call, reason)
  if all(isinstance(e, KernelCall) and e.backend == "xla" for e in entries.values()):
    return None
  other = (dataclasses.replace(call, backend="xla")
           if implementation is None and not call.batch_invariant else _no_kernel_message(
               implementation, call, "jax_flash has kernels for CPU and CUDA only"))
  return PerPlatform(cpu=entries["cpu"], cuda=entries["cuda"], other=other)


def _no_kernel_message(implementation, call: KernelCall, reason: str) -> str:
  if call.batch_invariant and implementation in (None, "xla"):
    return ("batch_invariant=True needs jax_flash's kernels (XLA's attention may change with "
            f"the batch), which cannot serve this call: {reason}")
  return f"implementation={implementation!r}: {reason}"


def _attention(q, k, v, shapes, *, scale, mask: Mask, q_lens, kv_lens, implementation,
               segment_ids=(None, None), softcap=0.0, sinks=None, deterministic=False,
               batch_invariant=False):
  """(out, lse) of validated arguments: the call's description (a
  KernelCall for the backend that serves it, the mask's arrays, the sinks)
  built once, handed to the differentiable kernel call."""
  dtype = jnp.result_type(q)
  # Raises here, while tracing, what the platform of the inputs cannot serve.
  platform = _platform_of(q, k, v)
  local = select_backend(implementation, platform, dtype, shapes)
  call = KernelCall(backend=local, scale=scale, mask=mask, softcap=softcap,
                    deterministic=deterministic, batch_invariant=batch_invariant)
  if (local == "gpu" or implementation in (None, "flash")) and ffi.gpu_compute_capability():
    if reason := _gpu_support.device_reason("backward", shapes.head_dim):
      call = (dataclasses.replace(call, backward_on_xla=True) if implementation is None else
              dataclasses.replace(call, backward_unavailable=(
                  f"implementation={implementation!r}: {reason}; implementation=None runs "
                  "XLA's backward instead")))
  if batch_invariant and local == "xla":
    reason = ("implementation='xla'" if implementation == "xla" else
              f"no kernel serves {np.dtype(dtype).name} head_dim {shapes.head_dim} on "
              f"platform {platform!r}")
    raise NotImplementedError(_no_kernel_message(None, call, reason))
  if implementation in (None, "flash"):
    call = _per_platform(implementation, call, dtype, shapes) or call
  q_segment_ids, kv_segment_ids = segment_ids
  if 0 in (shapes.batch, shapes.seq_q, shapes.seq_k, shapes.heads_q):
    return reference.attention_reference(
        q, k, v, scale=scale, **dataclasses.asdict(mask), q_lens=q_lens, kv_lens=kv_lens,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softcap=softcap,
        sinks=sinks)
  if q_lens is None:
    q_lens = whole_lengths(shapes.batch, shapes.seq_q)
  if kv_lens is None:
    kv_lens = whole_lengths(shapes.batch, shapes.seq_k)
  bounds = None
  if q_segment_ids is not None and runs_kernels(call):  # XLA skips no tiles by them
    bounds = segments.segment_bounds(q_segment_ids, kv_segment_ids)
  masks = MaskOperands.build((shapes.batch,), q_lens, kv_lens, q_segment_ids, kv_segment_ids,
                             bounds)
  return vjp.flash_attention(q, k, v, masks, sink_operand(sinks, q), call)


def attention(q, k, v, *, causal: bool = False, window=None, scale: float | None = None,
              query_seq_lengths=None, key_value_seq_lengths=None, segment_ids=None,
              softcap: float | None = None, sinks=None, deterministic: bool = False,
              batch_invariant: bool = False, return_lse: bool = False,
              implementation: str | None = None):
  """FlashAttention: ``softmax(scale * q k^T + mask) v`` without the score matrix.

  Args:
    q: queries ``[batch, seq_q, heads_q, head_dim]``.
    k: keys ``[batch, seq_k, heads_kv, head_dim]``; ``heads_q`` must be a
      multiple of ``heads_kv`` (GQA; MQA when ``heads_kv == 1``).
    v: values ``[batch, seq_k, heads_kv, head_dim_v]``.
    causal: mask keys after the query. For ``seq_q != seq_k`` the diagonal is
      aligned bottom-right, as in FlashAttention: query ``i`` sees key ``j``
      when ``j <= i + seq_k - seq_q``, so the last query sees every key (the
      decoding convention). Query rows that see no key output zeros.
    window: ``(left, right)`` sliding window around that same diagonal:
      query ``i`` sees keys ``i + seq_k - seq_q - left ... i + seq_k - seq_q
      + right``. ``None`` on a side (or for the whole window) is unbounded; an
      int is a symmetric window. Combines with ``causal``.
    scale: logit scale, ``1/sqrt(head_dim)`` by default.
    query_seq_lengths: optional int32 ``[batch]``; query rows past the length
      output zeros and get zero gradients.
    key_value_seq_lengths: optional int32 ``[batch]``; keys past the length
      are masked.
    segment_ids: packed documents: an int32 ``[batch, seq]`` array of document
      ids (self-attention, ``seq_q == seq_k``) or a ``(q_segment_ids
      [batch, seq_q], kv_segment_ids [batch, seq_k])`` pair. A query attends
      only to keys with its id; combines with every other mask (causal and
      window stay aligned to the whole row). The kernels skip the tiles
      between documents, so a packed row costs about the sum of its
      documents' work. Ids need not be sorted, but back-to-back documents
      skip best.
    softcap: cap the logits smoothly, ``softcap * tanh(logit / softcap)``
      with ``logit = scale * q.k`` (Gemma 2, Grok); ``None`` for no cap.
    sinks: attention sinks (gpt-oss): float32 ``[heads_q]``, one learnable
      logit per query head joining every row's softmax without a value,
      ``softmax([logits, sink])``; differentiable, ``None`` for none. A row
      that sees no key then outputs zeros with ``lse == sink``; a sink of
      ``-inf`` is no sink. The Hopper forward kernel adds them in its
      epilogue, with no pass over the output; elsewhere (other GPUs, CPU,
      XLA, decoding calls that pack heads or split keys) they are folded in
      after the kernel, one elementwise pass over the output
      (docs/numerics.md).
    deterministic: make the backward bitwise reproducible from run to run.
      The GPU backward then adds each query tile's dQ contributions in a
      fixed order (docs/history.md: its measured cost); the CPU kernels always are.
    batch_invariant: make each sequence's output bitwise independent of the
      rest of the batch (its size, the slot, the other sequences) and of the
      cache buffer's length past ``key_value_seq_lengths``. Only short
      queries whose rows see every key (decoding) may otherwise split the
      keys by the grid's size; with this set they split every 4096 keys of
      their own length on Hopper, giving ``paged_attention``'s result on the
      same cache, and not at all elsewhere. That costs speed where the grid
      split would have filled the GPU: up to 4x for one sequence of 4k keys,
      1-4% at batch 64 (docs/history-serving.md). XLA gives no such guarantee, so
      calls no kernel serves raise ``NotImplementedError``.
    return_lse: also return the log-sum-exp of the scaled, masked logits,
      float32 ``[batch, heads_q, seq_q]``, the sink included (``-inf`` for
      rows that see no key; with ``sinks``, their sink).
    implementation: ``None`` (default) runs the kernels of the platform the
      computation is lowered for (CPU or CUDA GPU; ``jax.export`` for other
      platforms than the exporting host's gets theirs) and falls back to
      plain XLA for cases those kernels do not cover; ``"flash"`` does the
      same but raises ``NotImplementedError`` instead of falling back (when
      tracing for the inputs' platform, when lowering for another);
      ``"cpu"`` / ``"gpu"`` force one kernel backend; ``"xla"`` is the plain
      XLA composition.

  NaN and Inf: a non-finite value in a position a query row sees makes that
  row's output (and, in q or k, its lse) NaN or Inf, as in a float32
  reference; positions a row does not see (past the lengths, other
  documents, outside the window or the causal mask) never reach its output,
  lse or gradients, whatever they hold. (So far the CPU kernels and XLA;
  not yet the GPU kernels.)

  Returns:
    ``out [batch, seq_q, heads_q, head_dim_v]``, or ``(out, lse)``.
  """
  validation.check_implementation(implementation)
  shapes = validation.check_qkv(q, k, v)
  scale = validation.check_scale(scale, shapes.head_dim)
  window = validation.check_window(window, "window")
  return_lse = validation.check_flag(return_lse, "return_lse")
  sinks = validation.check_sinks(sinks, shapes.heads_q)
  mask = Mask.of(causal=validation.check_flag(causal, "causal"), window=window,
                 diag_offset=shapes.seq_k - shapes.seq_q)
  out, lse = _attention(
      q, k, v, shapes, scale=scale, mask=mask,
      q_lens=validation.check_lengths(query_seq_lengths, "query_seq_lengths", shapes.batch),
      kv_lens=validation.check_lengths(key_value_seq_lengths, "key_value_seq_lengths",
                                       shapes.batch),
      segment_ids=validation.check_segment_ids(segment_ids, shapes),
      softcap=validation.check_softcap(softcap), sinks=sinks,
      deterministic=validation.check_flag(deterministic, "deterministic"),
      batch_invariant=validation.check_flag(batch_invariant, "batch_invariant"),
      implementation=implementation)
  return (out, lse) if return_lse else out


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal: bool = False,
                     window=None, scale: float | None = None, softcap: float | None = None,
                     sinks=None, deterministic: bool = False, return_lse: bool = False,
                     implementation: str | None = None):
  """Attention over a ragged batch packed into one sequence (FlashAttention's
  varlen interface).

  Args:
    q: ``[total_q, heads_q, head_dim]``, the documents back to back.
    k, v: ``[total_k, heads_kv, head_dim(_v)]``.
    cu_seqlens_q: int32 ``[num_docs + 1]``, document ``d`` is
      ``q[cu_seqlens_q[d]:cu_seqlens_q[d + 1]]``; starts at 0. Tokens past the
      last offset are padding: zero output, zero gradient.
    cu_seqlens_k: the same for ``k``/``v``; ``None`` means the documents of
      ``q`` (self-attention, the only case where ``causal``/``window`` apply:
      each document is then causal on its own).

  The offsets are checked (start at 0, never decrease, end within the packed
  tokens) only where they are concrete, that is outside ``jit``; under
  ``jit`` offsets that break these rules are not detected and give
  meaningless results, so check them in the data pipeline.

  ``softcap``, ``sinks`` and ``deterministic`` are those of ``attention``
  (padding tokens past the last offset see no key: with sinks their lse is
  the sink). Returns
  ``out [total_q, heads_q, head_dim_v]`` (and ``lse [heads_q, total_q]``),
  differentiable like ``attention``.
  """
  validation.check_flag(causal, "causal")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if jnp.ndim(x) != 3:
      raise ValueError(f"{name} must have rank 3 [total_tokens, heads, head_dim], got shape "
                       f"{jnp.shape(x)}")
  total_q, total_k = jnp.shape(q)[0], jnp.shape(k)[0]
  cu_seqlens_q = validation.check_offsets(cu_seqlens_q, "cu_seqlens_q", total_q)
  if cu_seqlens_k is None:
    if total_k != total_q:
      raise ValueError("without cu_seqlens_k, k must hold the documents of q: expected "
                       f"total_k == total_q == {total_q}, got {total_k}")
    cu_seqlens_k = cu_seqlens_q
  else:
    cu_seqlens_k = validation.check_offsets(cu_seqlens_k, "cu_seqlens_k", total_k)
    if causal or window is not None:
      raise NotImplementedError("causal or windowed varlen attention needs the documents of q "
                                "and k to coincide; pass cu_seqlens_k=None")
  ids = segments.varlen_segment_ids(cu_seqlens_q, total_q, cu_seqlens_k, total_k)
  result = attention(q[None], k[None], v[None], causal=causal, window=window, scale=scale,
                     segment_ids=(ids[0][None], ids[1][None]), softcap=softcap, sinks=sinks,
                     deterministic=deterministic, return_lse=return_lse,
                     implementation=implementation)
  if return_lse:
    return result[0][0], result[1][0]
  return result[0]


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal: bool = False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual: bool = False):
  """A drop-in replacement for ``jax.nn.dot_product_attention``.

  Same arguments, defaults and layouts (``BTNH`` or ``TNH``; causal and window
  masks aligned top-left as in ``jax.nn``). ``implementation`` takes
  ``None``, ``"flash"``, ``"xla"`` and ``"cudnn"``: ``"xla"`` and ``"cudnn"``
  call ``jax.nn.dot_product_attention`` with that implementation; ``"flash"``
  runs jax_flash's kernels and raises ``NotImplementedError`` for what they do
  not cover (``bias``, ``mask``, a ``scale`` traced under ``jit``,
  unsupported dtypes or head dims); ``None`` runs the kernels where they
  apply and ``jax.nn``'s XLA path elsewhere.

  One difference from ``jax.nn``'s XLA path: a query row that the masks leave
  without any key outputs zeros (as cuDNN does), not the mean of ``value``.
  """
  validation.check_implementation(implementation, (None, "flash", "xla", "cudnn"))
  is_causal = validation.check_flag(is_causal, "is_causal")
  return_residual = validation.check_flag(return_residual, "return_residual")
  if implementation in ("xla", "cudnn"):
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation=implementation,
        return_residual=return_residual)
  unsupported = [name for name, x in (("bias", bias), ("mask", mask)) if x is not None]
  if validation.is_traced(scale):  # the kernels take the scale as a static parameter
    unsupported.append("a traced scale")
  if unsupported:
    if implementation == "flash":
      raise NotImplementedError(f"implementation='flash' does not support {unsupported[0]}; "
                                "use implementation=None or 'xla'")
    return jax.nn.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, implementation="xla",
        return_residual=return_residual)

  out, lse = _jax_nn_conventions(
      query, key, value, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
      key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
      implementation=None if implementation is None else "flash")
  if not return_residual:
    return out
  residual = jnp.swapaxes(lse, -1, -2).astype(out.dtype)  # [..., N, T] -> [..., T, N]
  return out, jax.lax.stop_gradient(residual)


def _jax_nn_conventions(query, key, value, *, scale, is_causal: bool, query_seq_lengths,
                        key_value_seq_lengths, local_window_size, implementation, sinks=None):
  """(out, lse) from the kernels under ``jax.nn.dot_product_attention``'s
  conventions (``BTNH`` or ``TNH``, causal and window aligned top-left).
  ``sinks`` are ``attention``'s; jax.nn has none, jax_flash.nn passes them."""
  squeeze = jnp.ndim(query) == 3
  if squeeze:
    query, key, value = (jnp.asarray(x)[None] for x in (query, key, value))
  shapes = validation.check_qkv(query, key, value)
  if shapes.head_dim_v != shapes.head_dim:
    raise ValueError(f"value must have the key's shape {jnp.shape(key)}, got {jnp.shape(value)}")
  scale = validation.check_scale(scale, shapes.head_dim)
  window = validation.check_window(local_window_size, "local_window_size")
  sinks = validation.check_sinks(sinks, shapes.heads_q)
  out, lse = _attention(
      query, key, value, shapes, scale=scale, mask=Mask.of(causal=is_causal, window=window),
      q_lens=validation.check_lengths(query_seq_lengths, "query_seq_lengths", shapes.batch),
      kv_lens=validation.check_lengths(key_value_seq_lengths, "key_value_seq_lengths",
                                       shapes.batch),
      sinks=sinks, implementation=implementation)
  if squeeze:
    out, lse = out[0], lse[0]
  return out, lse
