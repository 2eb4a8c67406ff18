"""Binding to the compiled kernels through XLA's FFI.

Two libraries serve the calls (see docs/developing.md):

* ``_cpu_ffi``: a nanobind extension module holding the C++ CPU kernels;
* ``libjax_flash_cuda.so``: a plain C-ABI library holding the CuTe DSL GPU
  kernels and their CUDA handlers, loaded with ctypes. Holding no Python, it is
  independent of the interpreter version. ``JAX_FLASH_CUDA_LIBRARY`` points
  at another build of it.

Target names carry a version so that serialized exports keep resolving when a
later release changes a handler's signature: a new signature gets a new name
and the old handler stays registered.
"""

import ctypes
import dataclasses
import functools
import math
import operator
import os
import pathlib

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from jax_flash import _cpu_ffi
from jax_flash import _configs as configs
from jax_flash import _head_packing as head_packing
from jax_flash import _kv_split as kv_split
from jax_flash import _reference as reference
from jax_flash._sinks import add_sinks

_ABI_VERSION = "v2"
# The CUDA forward's own: v3 adds the sinks operand after q_bounds
# (kernel_api.h: JfFwdArgs.sinks), which only the Hopper kernel reads.
_GPU_FORWARD_VERSION = "v3"
# Versions whose handlers stay registered for serialized exports (v1: no
# softcap, no deterministic backward; v2 of the CUDA forward: no sinks), by
# direction: the library's symbol for each is its current one's, suffixed.
_OLD_CUDA_VERSIONS = {"fwd": ("v1", "v2"), "bwd": ("v1",)}
# Query rows per dq_semaphore entry (kernel_api.h: the smallest query tile of
# the GPU backward kernels).
_SEMAPHORE_ROWS = 32
_LIBRARY_DIR = pathlib.Path(_cpu_ffi.__file__).resolve().parent
_CUDA_LIBRARY_NAME = "libjax_flash_cuda.so"


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """The static part of one kernel call (hashable: a custom_vjp static arg).

  Query row i may attend to key column j when ``j >= i + diag_offset -
  window_left`` (if ``window_left >= 0``) and ``j <= i + diag_offset +
  window_right`` (if ``window_right >= 0``), within the sequence lengths.
  """

  backend: str  # "cpu", "gpu" or "xla" (reference.py's composition behind the same interface)
  scale: float
  diag_offset: int
  window_left: int  # -1: unbounded
  window_right: int  # -1: unbounded
  softcap: float = 0.0  # > 0: logits are softcap * tanh(logit / softcap)
  deterministic: bool = False  # backward: bitwise reproducible dQ
  batch_invariant: bool = False  # forward: key splits independent of the batch (kv_split.py)
  # Where the GPU's shared memory is too small for the backward's tiles
  # (_gpu_support.py): run XLA's backward, or the reason to raise when traced.
  backward_on_xla: bool = False
  backward_unavailable: str = ""

  def attributes(self, direction: str) -> dict:
    attrs = dict(scale=np.float32(self.scale), diag_offset=np.int32(self.diag_offset),
                 window_left=np.int32(self.window_left), window_right=np.int32(self.window_right),
                 softcap=np.float32(self.softcap))
    if direction == "bwd":
      attrs["deterministic"] = np.int32(self.deterministic)
    return attrs

  def mask(self) -> dict:
    """The mask and logit arguments of reference.py's functions."""
    return dict(scale=self.scale, diag_offset=self.diag_offset, window_left=self.window_left,
                window_right=self.window_right, softcap=self.softcap)


@dataclasses.dataclass(frozen=True)
class PerPlatform:
  """What serves one call on each platform it may be lowered for.

  The kernels are chosen when the computation is lowered, not when it is
  traced: ``jax.export`` lowers one trace for every platform it is asked
  for, whatever devices the exporting host has (``lax.platform_dependent``
  stages each branch; lowering keeps those of its platforms). ``cpu`` and
  ``cuda`` hold the KernelCall that serves the problem there, or the reason
  none may (``implementation="flash"``), which lowering for that platform
  raises as NotImplementedError; other platforms get ``other``, the XLA
  composition or a reason.
  """

  cpu: KernelCall | str
  cuda: KernelCall | str
  other: KernelCall | str


def _target(backend: str, direction: str, version: str | None = None) -> str:
  if version is None:
    version = _GPU_FORWARD_VERSION if (backend, direction) == ("gpu", "fwd") else _ABI_VERSION
  return f"jax_flash_{backend}_{direction}_{version}"


def _register_cpu() -> None:
  for name, capsule in _cpu_ffi.registrations().items():
    direction, version = name.split("_")
    jax.ffi.register_ffi_target(_target("cpu", direction, version), capsule, platform="cpu")


def _find_cuda_library() -> pathlib.Path | None:
  override = os.environ.get("JAX_FLASH_CUDA_LIBRARY")
  if override:
    path = pathlib.Path(override)
    if not path.is_file():
      raise FileNotFoundError(f"JAX_FLASH_CUDA_LIBRARY={override} does not name a file")
    return path
  path = _LIBRARY_DIR / _CUDA_LIBRARY_NAME
  return path if path.is_file() else None


_cuda_library: ctypes.CDLL | None = None


def _register_cuda() -> pathlib.Path | None:
  global _cuda_library
  path = _find_cuda_library()
  if path is None:
    return None
  library = _cuda_library = ctypes.CDLL(str(path))
  library.JaxFlashCudaHandlerCalls.restype = ctypes.c_int64
  for direction, symbol in (("fwd", "JaxFlashFwdCuda"), ("bwd", "JaxFlashBwdCuda")):
    capsule = jax.ffi.pycapsule(getattr(library, symbol))
    jax.ffi.register_ffi_target(_target("gpu", direction), capsule, platform="CUDA")
    for version in _OLD_CUDA_VERSIONS[direction]:
      capsule = jax.ffi.pycapsule(getattr(library, symbol + version.upper()))
      jax.ffi.register_ffi_target(_target("gpu", direction, version), capsule, platform="CUDA")
  return path


_register_cpu()
CUDA_LIBRARY: pathlib.Path | None = _register_cuda()


def cuda_kernels_available() -> bool:
  """Whether this installation holds the GPU kernels."""
  return CUDA_LIBRARY is not None


def cuda_handler_calls() -> int:
  """How many times XLA has called the CUDA handlers in this process (a
  replayed CUDA graph does not call them)."""
  if _cuda_library is None:
    raise RuntimeError("this installation holds no CUDA kernels")
  return int(_cuda_library.JaxFlashCudaHandlerCalls())


def no_segments(q):
  """The four packed-document operands of a call without segment ids."""
  empty = jnp.zeros((*q.shape[:-3], 0), jnp.int32)
  return (empty,) * 4


def no_sinks(q):
  """The sinks operand of a forward call without sinks: [..., heads_q, 0]."""
  return jnp.zeros((*q.shape[:-3], q.shape[-2], 0), jnp.float32)


def sink_operand(sinks, q):
  """float32 [heads_q] sinks as the forward's operand [..., heads_q, 1]: one
  per batch entry, so that it shards and maps like the lse."""
  return jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[:, None],
                          (*q.shape[:-3], q.shape[-2], 1))


def segment_operands(q_segment_ids, kv_segment_ids, kv_bounds, q_bounds):
  """The packed-document operands: ids [..., T] / [..., S] and bounds
  flattened to [..., 2T] / [..., 2S] (the layout of kernel_api.h)."""
  flat = lambda x: x.reshape(*x.shape[:-2], -1)
  return q_segment_ids, kv_segment_ids, flat(kv_bounds), flat(q_bounds)


def forward(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, sinks,
            call: KernelCall | PerPlatform):
  """Runs the forward kernel: returns (o [..., T, N, Hv], lse [..., N, T] f32).

  The four segment operands come from ``segment_operands`` or ``no_segments``,
  the sinks from ``sink_operand`` or ``no_sinks``; the results include the
  sinks (kernel_applies_sinks says who adds them). Short GQA problems run
  with their query heads packed (head_packing.py).
  """
  args = (q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, sinks)
  if isinstance(call, KernelCall):
    return _forward_on(*args, call)
  *batch, seq_q, heads_q, _ = q.shape
  out_types = (jax.ShapeDtypeStruct((*batch, seq_q, heads_q, v.shape[-1]), q.dtype),
               jax.ShapeDtypeStruct((*batch, heads_q, seq_q), jnp.float32))
  return _per_platform(_forward_on, call, out_types, args)


def backward(q, k, v, dout, lse, delta, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds,
             call: KernelCall | PerPlatform):
  """Runs the backward kernel: returns (dq f32, dk, dv)."""
  args = (q, k, v, dout, lse, delta, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds)
  if isinstance(call, KernelCall):
    return _backward_on(*args, call)
  out_types = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype))
  return _per_platform(_backward_on, call, out_types, args)


def _varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over inside ``shard_map``."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", ()))


def match_varying(outputs, inputs):
  """Casts each array of ``outputs`` to vary over every manual mesh axis that
  some array of ``inputs`` varies over. A kernel's result depends on all its
  inputs, but an FFI call's abstract evaluation leaves it invariant."""
  axes = frozenset().union(*(_varying_axes(x) for x in jax.tree.leaves(inputs)))
  if not axes:
    return outputs

  def cast(x):
    missing = tuple(sorted(axes - _varying_axes(x), key=str))
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, outputs)


def _per_platform(run, call: PerPlatform, out_types, args):
  """``run(*args, entry)`` with the entry of ``call`` for the lowering platform."""

  def branch(entry):
    # Inside shard_map every branch must give the same types, which match_varying makes so.
    if isinstance(entry, KernelCall):
      return lambda *a: match_varying(run(*a, entry), a)
    return lambda *a: match_varying(tuple(_unsupported_p.bind(
        *(jnp.zeros(t.shape, t.dtype) for t in out_types), reason=entry)), a)

  return jax.lax.platform_dependent(*args, cpu=branch(call.cpu), cuda=branch(call.cuda),
                                    default=branch(call.other))


# Stands in for the kernel call on a platform that cannot serve it: the trace
# holds every platform's branch, and only lowering for this one must fail.
_unsupported_p = jax.extend.core.Primitive("jax_flash_unsupported")
_unsupported_p.multiple_results = True
_unsupported_p.def_abstract_eval(lambda *avals, reason: list(avals))


def _raise_unsupported(ctx, *args, reason):
  raise NotImplementedError(reason)


mlir.register_lowering(_unsupported_p, _raise_unsupported)


def _value_padding(q, v, q_ids, call: KernelCall, direction: str) -> int:
  """Zero columns the ``call.backend`` kernels of ``direction`` need appended
  to V (configs.BackendSupport.value_padding): Hopper's own kernels take some
  narrower V as it is, its forward always, its backward where it serves."""
  hopper = call.backend == "gpu" and (gpu_compute_capability() or (0,))[0] == 9
  if direction == "bwd":
    hopper = hopper and configs.sm90_backward_serves(
        deterministic=call.deterministic, has_segments=q_ids.shape[-1] > 0,
        softcap=call.softcap > 0, batch=math.prod(q.shape[:-3]), heads_kv=v.shape[-2])
  return configs.BACKENDS[call.backend].value_padding(q.shape[-1], v.shape[-1], hopper)


def _pad_last(x, padding: int):
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padding)]) if padding else x


def kernel_applies_sinks(q, k, v, q_ids, call: KernelCall) -> bool:
  """Whether the forward kernel of this call adds the sinks itself (v: as
  the kernel gets it, padded): the Hopper one (cuda_src/fwd_sm90/
  output_tile.py) where it serves the call whole, with its query heads
  unpacked (a packed row's head is not the kernel's) and its keys unsplit (a
  split's lse is no row's). Elsewhere ``_forward_on`` adds them to the
  call's results (add_sinks): one more pass over the output."""
  if call.backend != "gpu" or (gpu_compute_capability() or (0,))[0] != 9:
    return False
  has_segments = q_ids.shape[-1] > 0
  if (head_packing.group(q, k, call) > 1
      or kv_split.fixed_split_applies(q, k, v, call, has_segments=has_segments, hopper=True)
      or kv_split.parts(q, k, call, has_segments=has_segments) > 1):
    return False
  # What jax_flash_fwd_sm90_can_implement asks (fwd_sm90/launch.cc: Serves).
  return (k.shape[-3] > 0 and math.prod(q.shape[:-3]) <= configs.MAX_GRID_YZ
          and q.shape[-2] <= configs.MAX_GRID_YZ
          and _sm90_forward_has_variant(np.dtype(q.dtype).name, q.shape[-1], v.shape[-1],
                                        has_segments))


# kernel_api.h's JfDtype of the GPU kernels' dtypes.
_JF_DTYPES = {"float16": 0, "bfloat16": 1}


@functools.cache
def _sm90_forward_has_variant(dtype: str, head_dim: int, head_dim_v: int,
                              has_segments: bool) -> bool:
  query = getattr(_cuda_library, "jax_flash_fwd_sm90_has_variant", None)
  if query is None or dtype not in _JF_DTYPES:  # no Hopper kernels in this build
    return False
  query.argtypes = (ctypes.c_int32,) * 4
  query.restype = ctypes.c_int
  return bool(query(_JF_DTYPES[dtype], head_dim, head_dim_v, int(has_segments)))


def _forward_on(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, sinks,
                call: KernelCall):
  masks = (q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds)
  if call.backend == "xla":
    out, lse = reference.forward_like_kernels(q, k, v, q_lens, kv_lens, q_ids, kv_ids,
                                              **call.mask())
    return _with_sinks(out, lse, sinks)
  head_dim_v = v.shape[-1]
  v = _pad_last(v, _value_padding(q, v, q_ids, call, "fwd"))
  if sinks.shape[-1] and kernel_applies_sinks(q, k, v, q_ids, call):
    out, lse = _forward(q, k, v, *masks, sinks, call)
    return out[..., :head_dim_v], lse
  out, lse = _packed_forward(q, k, v, *masks, call)
  return _with_sinks(out[..., :head_dim_v], lse, sinks)


def _with_sinks(out, lse, sinks):
  """A forward's (out, lse) with ``sinks`` (sink_operand / no_sinks) added."""
  return add_sinks(out, lse, sinks[..., 0]) if sinks.shape[-1] else (out, lse)


def _packed_forward(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, call):
  size = head_packing.group(q, k, call)
  if size > 1:
    q_lens, q_ids, kv_bounds, q_bounds = head_packing.pack_masks(q_lens, q_ids, kv_bounds,
                                                                 q_bounds, size)
    out, lse = _split_or_whole_forward(head_packing.pack_rows(q, size), k, v, q_lens, kv_lens,
                                       q_ids, kv_ids, kv_bounds, q_bounds,
                                       head_packing.unmasked(call))
    return head_packing.unpack_rows(out, size), head_packing.unpack_stats(lse, size)
  return _split_or_whole_forward(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds,
                                 call)


def _split_or_whole_forward(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, call):
  has_segments = q_ids.shape[-1] > 0
  if kv_split.fixed_split_applies(q, k, v, call, has_segments=has_segments,
                                  hopper=(gpu_compute_capability() or (0,))[0] == 9):
    return kv_split.fixed_split_forward(q, k, v, q_lens, kv_lens, call)
  parts = kv_split.parts(q, k, call, has_segments=has_segments)
  if parts > 1:
    return kv_split.split_forward(_forward, q, k, v, q_lens, kv_lens,
                                  (q_ids, kv_ids, kv_bounds, q_bounds, no_sinks(q)), call, parts)
  return _forward(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, no_sinks(q), call)


def _forward(q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds, sinks,
             call: KernelCall):
  """One forward kernel call; ``sinks`` (sink_operand / no_sinks) reach the
  GPU handler, which takes them (v3), and only where kernel_applies_sinks."""
  *batch, seq_q, heads_q, _ = q.shape
  out_types = (
      jax.ShapeDtypeStruct((*batch, seq_q, heads_q, v.shape[-1]), q.dtype),
      jax.ShapeDtypeStruct((*batch, heads_q, seq_q), jnp.float32),
  )
  kernel = jax.ffi.ffi_call(_target(call.backend, "fwd"), out_types, vmap_method="broadcast_all")
  operands = (q, k, v, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds)
  if call.backend == "gpu":
    operands += (sinks,)
  elif sinks.shape[-1]:
    raise NotImplementedError(f"the {call.backend} forward kernels take no sinks")
  return kernel(*operands, **call.attributes("fwd"))


def _backward_on(q, k, v, dout, lse, delta, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds,
                 call: KernelCall):
  if call.backward_unavailable and call.backend == "gpu":
    raise NotImplementedError(call.backward_unavailable)
  if call.backend == "xla" or (call.backward_on_xla and call.backend == "gpu"):
    return reference.backward_like_kernels(q, k, v, dout, lse, delta, q_lens, kv_lens, q_ids,
                                           kv_ids, **call.mask())
  # Zero columns of V and dout change neither dP nor dQ / dK; their dV
  # columns are cut off.
  head_dim_v = v.shape[-1]
  padding = _value_padding(q, v, q_ids, call, "bwd")
  v, dout = _pad_last(v, padding), _pad_last(dout, padding)
  dq, dk, dv = _packed_backward(q, k, v, dout, lse, delta, q_lens, kv_lens, q_ids, kv_ids,
                                kv_bounds, q_bounds, call)
  return dq, dk, dv[..., :head_dim_v]


def _packed_backward(q, k, v, dout, lse, delta, q_lens, kv_lens, q_ids, kv_ids, kv_bounds,
                     q_bounds, call: KernelCall):
  size = head_packing.group(q, k, call)
  if size > 1:
    q_lens, q_ids, kv_bounds, q_bounds = head_packing.pack_masks(q_lens, q_ids, kv_bounds,
                                                                 q_bounds, size)
    rows = lambda x: head_packing.pack_rows(x, size)
    stats = lambda x: head_packing.pack_stats(x, size)
    dq, dk, dv = _backward(rows(q), k, v, rows(dout), stats(lse), stats(delta), q_lens, kv_lens,
                           q_ids, kv_ids, kv_bounds, q_bounds, head_packing.unmasked(call))
    return head_packing.unpack_rows(dq, size), dk, dv
  return _backward(q, k, v, dout, lse, delta, q_lens, kv_lens, q_ids, kv_ids, kv_bounds,
                   q_bounds, call)


def _backward(q, k, v, dout, lse, delta, q_lens, kv_lens, q_ids, kv_ids, kv_bounds, q_bounds,
              call: KernelCall):
  *batch, seq_q, heads_q, _ = q.shape
  # The deterministic GPU kernels order their dQ additions through this
  # scratch; otherwise it is empty.
  chains = _dq_chains(q, v, q_ids, call)
  tiles = chains * -(-seq_q // _SEMAPHORE_ROWS) if call.deterministic else 0
  rows = _dq_tile_rows(q, v, q_ids, call)
  dq_shape = (chains, *q.shape) if chains > 1 else q.shape
  if rows:
    dq_shape = (*batch, chains, heads_q, -(-seq_q // rows), rows, q.shape[-1])
  out_types = (
      jax.ShapeDtypeStruct(dq_shape, jnp.float32),
      jax.ShapeDtypeStruct(k.shape, k.dtype),
      jax.ShapeDtypeStruct(v.shape, v.dtype),
      jax.ShapeDtypeStruct((*batch, heads_q, tiles), jnp.int32),
  )
  kernel = jax.ffi.ffi_call(_target(call.backend, "bwd"), out_types, vmap_method="broadcast_all")
  dq, dk, dv, turns = kernel(q, k, v, dout, lse, delta, q_lens, kv_lens, q_ids, kv_ids, kv_bounds,
                             q_bounds, **call.attributes("bwd"))
  if rows:
    dq = jnp.moveaxis(_dq_from_tiles(dq, seq_q), -4, 0)  # chains first, as in q's layout
    if chains == 1:
      dq = dq[0]
  query_tile = _first_turn_query_tile(q, v, q_ids, call)
  if query_tile:
    dq = _written_tiles_only(dq, turns, query_tile, chains)
  if chains > 1:
    dq = functools.reduce(operator.add, list(dq))  # in order: the same sum every run
  return dq, dk, dv


def _first_turn_query_tile(q, v, q_ids, call: KernelCall) -> int:
  """The query rows per dq_semaphore turn of the Hopper deterministic
  backward where it serves the call, else 0. Its first turn at each dQ tile
  stores the tile instead of adding it, so dq_accum is not zeroed first and a
  tile that no turn reached holds whatever the buffer held
  (cuda_src/bwd_sm90/warp_roles.py, _write_dq)."""
  if not call.deterministic or call.backend != "gpu" or (gpu_compute_capability() or (0,))[0] != 9:
    return 0
  if q.dtype not in (jnp.float16, jnp.bfloat16):
    return 0
  serves = configs.sm90_backward_serves(
      deterministic=True, has_segments=q_ids.shape[-1] > 0, softcap=call.softcap > 0,
      batch=math.prod(q.shape[:-3]), heads_kv=v.shape[-2])
  return _sm90_deterministic_query_tile(q.shape[-1], v.shape[-1]) if serves else 0


@functools.cache
def _sm90_deterministic_query_tile(head_dim: int, head_dim_v: int) -> int:
  query = getattr(_cuda_library, "jax_flash_bwd_sm90_deterministic_query_tile", None)
  if query is None:  # no Hopper kernels in this build, or one that zeroes dq_accum
    return 0
  query.argtypes = (ctypes.c_int32, ctypes.c_int32)
  query.restype = ctypes.c_int
  return int(query(head_dim, head_dim_v))


def _written_tiles_only(dq, turns, query_tile: int, chains: int):
  """dq ([chains,] *batch, seq_q, heads, dim) with zeros in the query tiles
  whose count of turns is 0 in `turns` ([*batch, heads, entries], entry
  tile x chains + chain; kernel_api.h: dq_semaphore)."""
  *batch, heads, _ = turns.shape
  seq_q = dq.shape[-3]
  tiles = -(-seq_q // query_tile)
  written = turns[..., :tiles * chains].reshape(*batch, heads, tiles, chains) > 0
  written = jnp.repeat(written, query_tile, axis=-2)[..., :seq_q, :]  # [*batch, heads, seq_q, chains]
  written = jnp.swapaxes(jnp.moveaxis(written, -1, 0), -1, -2)[..., None]  # [chains, *batch, seq_q, heads, 1]
  return jnp.where(written if chains > 1 else written[0], dq, 0.0)


def _dq_tile_rows(q, v, q_ids, call: KernelCall) -> int:
  """The query rows of the tiles in which the Hopper backward kernels of
  these head dims take dq_accum (kernel_api.h: dq_tile_rows), where they
  serve the call; else 0, dq_accum in q's layout."""
  if call.backend != "gpu" or (gpu_compute_capability() or (0,))[0] != 9:
    return 0
  if q.dtype not in (jnp.float16, jnp.bfloat16):
    return 0
  serves = configs.sm90_backward_serves(
      deterministic=call.deterministic, has_segments=q_ids.shape[-1] > 0, softcap=call.softcap > 0,
      batch=math.prod(q.shape[:-3]), heads_kv=v.shape[-2])
  return _sm90_dq_tile_rows(q.shape[-1], v.shape[-1]) if serves else 0


@functools.cache
def _sm90_dq_tile_rows(head_dim: int, head_dim_v: int) -> int:
  query = getattr(_cuda_library, "jax_flash_bwd_sm90_dq_tile_rows", None)
  if query is None:  # no Hopper kernels in this build, or one from before dQ in tiles
    return 0
  query.argtypes = (ctypes.c_int32, ctypes.c_int32)
  query.restype = ctypes.c_int
  return int(query(head_dim, head_dim_v))


def _dq_from_tiles(dq, seq_q: int):
  """[*lead, heads, tiles, 64, dim] in the element order of the Hopper
  kernels' dQ fragments (cuda_src/bwd_sm90/wgmma_views.py:
  store_dq_fragments) -> [*lead, seq_q, heads, dim]."""
  *lead, heads, tiles, rows, dim = dq.shape
  if rows != 64:
    raise NotImplementedError(f"dq_accum in tiles of {rows} query rows; the fragment order is that of 64")
  # A tile's floats by (WG, warp, column octet, row half, lane row, lane column, pair element).
  x = dq.reshape(*lead, heads, tiles, 2, 4, dim // 16, 2, 8, 4, 2)
  n = len(lead)
  rows_first = (*range(n), n + 1, n + 3, n + 5, n + 6, n, n + 2, n + 4, n + 7, n + 8)
  x = x.transpose(rows_first).reshape(*lead, tiles * rows, heads, dim)
  return x[..., :seq_q, :, :]


def _dq_chains(q, v, q_ids, call: KernelCall) -> int:
  """How many dQ accumulators the backward kernel gets (kernel_api.h:
  dq_chains): more only where Hopper's deterministic kernel runs without a
  mask, the only case in which it uses them (cuda_src/bwd_sm90/warp_roles.py,
  "dQ chains"), as many as it asks for these keys."""
  if not (call.deterministic and call.backend == "gpu" and (gpu_compute_capability() or (0,))[0] == 9):
    return 1
  if call.window_left >= 0 or call.window_right >= 0:
    return 1
  serves = configs.sm90_backward_serves(
      deterministic=True, has_segments=q_ids.shape[-1] > 0, softcap=call.softcap > 0,
      batch=math.prod(q.shape[:-3]), heads_kv=v.shape[-2])
  return _sm90_deterministic_dq_chains(q.shape[-1], v.shape[-1], v.shape[-3]) if serves else 1


@functools.cache
def _sm90_deterministic_dq_chains(head_dim: int, head_dim_v: int, seq_k: int) -> int:
  query = getattr(_cuda_library, "jax_flash_bwd_sm90_deterministic_dq_chains", None)
  if query is None:  # no Hopper kernels in this build, or one from before the query
    return 1
  query.argtypes = (ctypes.c_int32,) * 3
  query.restype = ctypes.c_int
  return int(query(head_dim, head_dim_v, seq_k))


@functools.cache
def gpu_compute_capability() -> tuple[int, int] | None:
  """The first GPU's compute capability, or None without a CUDA device."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None
  capability = getattr(devices[0], "compute_capability", None)
  if capability is None:
    return None
  major, minor = str(capability).split(".")
  return int(major), int(minor)
