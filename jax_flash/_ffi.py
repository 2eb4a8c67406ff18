"""Binding to the compiled kernels through XLA's FFI.

Two libraries serve the calls (see docs/developing.md):

* ``_cpu_ffi``: a nanobind extension module holding the C++ CPU kernels;
* ``libjax_flash_cuda.so``: a plain C-ABI library holding the CuTe DSL GPU
  kernels and their CUDA handlers, loaded with ctypes. Holding no Python, it is
  independent of the interpreter version. ``JAX_FLASH_CUDA_LIBRARY`` points
  at another build of it.

Beside the registration: the two kernel calls (``forward_kernel``,
``backward_kernel``: one ``jax.ffi.ffi_call`` each, on operands a plan has
prepared, ``_kernels.py``), what the library says of its own variants
(``sm90_*``) and the device's compute capability.

Target names carry a version so that serialized exports keep resolving when a
later release changes a handler's signature: a new signature gets a new name
and the old handler stays registered.
"""

import ctypes
import functools
import os
import pathlib

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import mlir

from jax_flash import _cpu_ffi
from jax_flash._call import KernelCall, MaskOperands

_ABI_VERSION = "v2"
# The CUDA forward's own: v3 adds the sinks operand after q_bounds
# (kernel_api.h: JfFwdArgs.sinks), which only the Hopper kernel reads.
_GPU_FORWARD_VERSION = "v3"
# Versions whose handlers stay registered for serialized exports (v1: no
# softcap, no deterministic backward; v2 of the CUDA forward: no sinks), by
# direction: the library's symbol for each is its current one's, suffixed.
_OLD_CUDA_VERSIONS = {"fwd": ("v1", "v2"), "bwd": ("v1",)}
_LIBRARY_DIR = pathlib.Path(_cpu_ffi.__file__).resolve().parent
_CUDA_LIBRARY_NAME = "libjax_flash_cuda.so"


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


# Stands in for the kernel call on a platform that cannot serve it: the trace
# holds every platform's branch, and only lowering for this one must fail.
_unsupported_p = jax.extend.core.Primitive("jax_flash_unsupported")
_unsupported_p.multiple_results = True
_unsupported_p.def_abstract_eval(lambda *avals, reason: list(avals))


def _raise_unsupported(ctx, *args, reason):
  raise NotImplementedError(reason)


mlir.register_lowering(_unsupported_p, _raise_unsupported)


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


# kernel_api.h's JfDtype of the GPU kernels' dtypes.
_JF_DTYPES = {"float16": 0, "bfloat16": 1}


def register_cuda_handler(handler_name: str, target: str, has_kernel) -> bool:
  """Registers the library's FFI handler ``handler_name`` as ``target`` where
  the library holds it and ``has_kernel(library)``; whether it did. Every
  CUDA build has every handler; the kernels behind one may be missing."""
  library = _cuda_library
  handler = getattr(library, handler_name, None) if library is not None else None
  if handler is None or not has_kernel(library):
    return False
  jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="CUDA")
  return True


def _library_query(symbol: str, arity: int):
  """The library's C function ``symbol`` taking ``arity`` int32, or None in
  a build without it (no Hopper kernels, or one from before the query)."""
  query = getattr(_cuda_library, symbol, None)
  if query is not None:
    query.argtypes = (ctypes.c_int32,) * arity
    query.restype = ctypes.c_int
  return query


@functools.cache
def sm90_forward_has_variant(dtype: str, head_dim: int, head_dim_v: int,
                             has_segments: bool) -> bool:
  """Whether the library holds a Hopper forward variant of these dims
  (kernel_api.h: jax_flash_fwd_sm90_has_variant)."""
  query = _library_query("jax_flash_fwd_sm90_has_variant", 4)
  if query is None or dtype not in _JF_DTYPES:
    return False
  return bool(query(_JF_DTYPES[dtype], head_dim, head_dim_v, int(has_segments)))


@functools.cache
def sm90_backward_has_variant(dtype: str, head_dim: int, head_dim_v: int, deterministic: bool,
                              has_segments: bool, softcap: bool) -> bool:
  """Whether the library holds a Hopper backward variant of these dims and
  kind (kernel_api.h: jax_flash_bwd_sm90_has_variant)."""
  query = _library_query("jax_flash_bwd_sm90_has_variant", 6)
  if query is None or dtype not in _JF_DTYPES:
    return False
  return bool(query(_JF_DTYPES[dtype], head_dim, head_dim_v, int(deterministic),
                    int(has_segments), int(softcap)))


@functools.cache
def sm90_dq_tile_rows(head_dim: int, head_dim_v: int) -> int:
  """The query rows of the tiles in which the Hopper backward kernels of
  these head dims take dq_accum (kernel_api.h: dq_tile_rows); 0: q's layout."""
  query = _library_query("jax_flash_bwd_sm90_dq_tile_rows", 2)
  return 0 if query is None else int(query(head_dim, head_dim_v))


@functools.cache
def sm90_deterministic_query_tile(head_dim: int, head_dim_v: int) -> int:
  """The query rows per dq_semaphore turn of the Hopper deterministic
  backward, whose first turn at each dQ tile stores the tile instead of
  adding it (cuda_src/bwd_sm90/warp_roles.py, _write_dq); 0: none, or a
  build that zeroes dq_accum."""
  query = _library_query("jax_flash_bwd_sm90_deterministic_query_tile", 2)
  return 0 if query is None else int(query(head_dim, head_dim_v))


@functools.cache
def sm90_deterministic_dq_chains(head_dim: int, head_dim_v: int, seq_k: int) -> int:
  """How many dQ accumulators the unmasked Hopper deterministic backward
  asks for at these keys (cuda_src/bwd_sm90/warp_roles.py, "dQ chains")."""
  query = _library_query("jax_flash_bwd_sm90_deterministic_dq_chains", 3)
  return 1 if query is None else int(query(head_dim, head_dim_v, seq_k))


def forward_kernel(q, k, v, masks: MaskOperands, sinks, call: KernelCall):
  """One forward kernel call: (o [..., T, N, Hv], lse [..., N, T] f32).
  ``sinks`` (_call.sink_operand) reach the GPU handler, which takes them
  (v3) and adds them only where the Hopper kernel serves the call."""
  *batch, seq_q, heads_q, _ = q.shape
  out_types = (
      jax.ShapeDtypeStruct((*batch, seq_q, heads_q, v.shape[-1]), q.dtype),
      jax.ShapeDtypeStruct((*batch, heads_q, seq_q), jnp.float32),
  )
  kernel = jax.ffi.ffi_call(_target(call.backend, "fwd"), out_types, vmap_method="broadcast_all")
  operands = (q, k, v, *masks.leaves())
  if call.backend == "gpu":
    operands += (sinks,)
  elif sinks.shape[-1]:
    raise NotImplementedError(f"the {call.backend} forward kernels take no sinks")
  return kernel(*operands, **call.attributes("fwd"))


def backward_kernel(q, k, v, dout, lse, delta, masks: MaskOperands, call: KernelCall, *,
                    dq_shape: tuple, semaphore_entries: int):
  """One backward kernel call: (dq_accum f32 of ``dq_shape``, dk, dv, the
  turn counters [..., N, semaphore_entries] int32), kernel_api.h's layouts."""
  *batch, _, heads_q, _ = q.shape
  out_types = (
      jax.ShapeDtypeStruct(dq_shape, jnp.float32),
      jax.ShapeDtypeStruct(k.shape, k.dtype),
      jax.ShapeDtypeStruct(v.shape, v.dtype),
      jax.ShapeDtypeStruct((*batch, heads_q, semaphore_entries), jnp.int32),
  )
  kernel = jax.ffi.ffi_call(_target(call.backend, "bwd"), out_types, vmap_method="broadcast_all")
  return kernel(q, k, v, dout, lse, delta, *masks.leaves(), **call.attributes("bwd"))
